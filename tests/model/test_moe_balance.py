"""Balancing (docs/model.md §5, §10 item 11): Quantile Balancing (exact/histogram), sign updates, the aux loss, and
layout invariance of the statistics (two simulated data-parallel ranks / micro-batches == one batch)."""

from __future__ import annotations

import pytest
import torch

from model.config import K3Config
from model.moe.balance import Balancer, exact_quantile, histogram_counts, histogram_quantile, sequence_aux_loss
from model.moe.router import Router, select_experts


def _balancer(mode="quantile", estimator="exact", E=16, k=2, **kw) -> Balancer:
    cfg = K3Config.preset(
        "tiny",
        hidden_size=32,
        num_experts=E,
        num_experts_per_token=k,
        moe_balance=mode,
        moe_balance_estimator=estimator,
        **kw,
    )
    return Balancer(cfg, Router(cfg))


def _skewed_scores(m=4096, E=16, seed=0) -> torch.Tensor:
    """A fixed batch whose expert popularity falls like 1/rank (early-training skew)."""
    g = torch.Generator().manual_seed(seed)
    skew = 1.5 * torch.log(1.0 / torch.arange(1, E + 1, dtype=torch.float64))
    return torch.sigmoid(torch.randn(m, E, dtype=torch.float64, generator=g) + skew)


def _cv(scores, bias, k) -> float:
    idx, _ = select_experts(scores, bias, k)
    load = torch.bincount(idx.reshape(-1), minlength=scores.shape[1]).double()
    return float(load.std(unbiased=False) / load.mean())


def _qb_iterate(bal: Balancer, scores: torch.Tensor, steps: int) -> list[float]:
    cvs = [_cv(scores, bal.bias, bal.k)]
    for _ in range(steps):
        idx, _ = select_experts(scores, bal.bias, bal.k)
        bal.update(bal.observe(scores, idx))
        cvs.append(_cv(scores, bal.bias, bal.k))
    return cvs


def test_qb_drives_load_cv_from_above_1_to_below_0_05_in_5_updates():
    bal = _balancer()
    cvs = _qb_iterate(bal, _skewed_scores(), 5)
    assert cvs[0] > 1.0
    assert min(cvs[1:]) < 0.05 and cvs[-1] < 0.05, cvs


def test_qb_bias_is_mean_centred():
    bal = _balancer()
    _qb_iterate(bal, _skewed_scores(m=512), 2)
    assert abs(float(bal.bias.double().mean())) < 1e-6
    assert float(bal.bias.abs().max()) > 0.01


def test_qb_exact_bias_is_the_centred_k_over_e_quantile_of_margins():
    bal = _balancer(E=8, k=2)
    scores = torch.rand(1000, 8, dtype=torch.float64)
    err = bal.update(bal.observe(scores, select_experts(scores, bal.bias, 2)[0]))
    alpha = torch.sort(scores, dim=1, descending=True).values[:, 2:3]  # (k+1)-th largest of s + 0
    r = alpha - scores  # expert j joins token i's top-k iff b_j > r_ij
    target = torch.stack([torch.sort(r[:, j]).values[249:251].mean() for j in range(8)])  # 250 = 1000*k/E below
    torch.testing.assert_close(bal.bias.double(), target - target.mean(), rtol=0, atol=1e-6)
    below, at_or_below = (r < target).double().mean(0), (r <= target).double().mean(0)
    assert (below <= 0.25).all() and (at_or_below >= 0.25).all()  # r = 0 ties (the (k+1)-th expert) straddle it
    assert err == pytest.approx(float((below - 0.25).abs().max()))


def test_exact_quantile_puts_fraction_q_strictly_below():
    r = torch.randn(4000, 5, dtype=torch.float64)
    b = exact_quantile(r, 0.125)
    assert ((r < b).double().mean(0) == 0.125).all()


def test_histogram_quantile_close_to_exact_quantile():
    r = torch.rand(20000, 6, dtype=torch.float64) * 2 - 1
    lo, hi = -1.5, 1.5
    h = histogram_counts(r, lo, hi, 1000)
    assert int(h.sum()) == r.numel() and int(h[:, 0].sum()) == 0 and int(h[:, -1].sum()) == 0
    torch.testing.assert_close(histogram_quantile(h, lo, hi, 0.1), exact_quantile(r, 0.1), rtol=0, atol=3e-3)


def test_histogram_qb_close_to_exact_qb():
    scores = _skewed_scores(m=4096)
    ex, hist = _balancer(estimator="exact"), _balancer(estimator="histogram")
    for _ in range(3):
        for bal in (ex, hist):
            bal.update(bal.observe(scores, select_experts(scores, bal.bias, 2)[0]))
        # width of one bin over [min b - 1, max b + 1] is ~3e-3 here
        assert float((ex.bias - hist.bias).abs().max()) < 1e-2
    assert _cv(scores, hist.bias, 2) < 0.1


def test_sign_update_moves_bias_by_gamma_towards_underloaded_experts():
    bal = _balancer(mode="sign", E=4, k=1, moe_sign_update_rate=0.01)
    idx = torch.tensor([[0], [0], [0], [1], [2], [2], [0], [1]])  # loads 4, 2, 2, 0; mean 2
    bal.update(bal.observe(torch.rand(8, 4), idx))
    torch.testing.assert_close(bal.bias, torch.tensor([-0.01, 0.0, 0.0, 0.01]))


def test_none_and_aux_leave_bias_unchanged():
    for mode in ("none", "aux"):
        bal = _balancer(mode=mode)
        scores = _skewed_scores(m=256)
        stats = bal.observe(scores, select_experts(scores, bal.bias, 2)[0])
        assert bal.update(stats) is None and torch.equal(bal.bias, torch.zeros(16))
        assert int(stats.counts_E.sum()) == 256 * 2 and stats.margins_NE is None and stats.hist_EB is None


def _aux_reference(scores_BTE, idx_BTK, coef):
    B, T, E = scores_BTE.shape
    K = idx_BTK.shape[-1]
    total = 0.0
    for b in range(B):
        for j in range(E):
            f = E / (K * T) * sum(int(j in idx_BTK[b, t].tolist()) for t in range(T))
            p = sum(scores_BTE[b, t, j] / scores_BTE[b, t].sum() for t in range(T)) / T
            total = total + f * p
    return coef * total / B


def test_aux_loss_matches_per_sequence_reference():
    s = torch.rand(3, 7, 6, dtype=torch.float64)
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(21)]).view(3, 7, 2)
    got = sequence_aux_loss(s.view(21, 6), idx.view(21, 2), batch=3, coef=0.1)
    torch.testing.assert_close(got, _aux_reference(s, idx, 0.1))


def test_aux_loss_gradient_matches_finite_differences():
    logits = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(5)[:2] for _ in range(10)])
    assert torch.autograd.gradcheck(lambda x: sequence_aux_loss(torch.sigmoid(x), idx, batch=2, coef=0.3), (logits,))


def test_layer_returns_differentiable_aux_loss_in_aux_mode():
    from model.moe.layer import LatentMoE

    cfg = K3Config.preset("tiny", moe_balance="aux", moe_aux_loss_coef=0.01)
    moe = LatentMoE(cfg, 1).train()
    _, stats = moe(torch.randn(2, 5, cfg.hidden_size))
    assert stats.aux_loss is not None and stats.aux_loss.requires_grad
    stats.aux_loss.backward()
    assert moe.gate.weight.grad.abs().sum() > 0
    _, eval_stats = moe.eval()(torch.randn(2, 5, cfg.hidden_size))
    assert eval_stats.aux_loss is None


def _observe_parts(bal: Balancer, parts: list[torch.Tensor]):
    """Statistics of several micro-batches / ranks, merged the way the trainer reduces them."""
    stats = [bal.observe(p, select_experts(p, bal.bias, bal.k)[0]) for p in parts]
    out = stats[0]
    for s in stats[1:]:
        out = out.merge(s)
    return out


@pytest.mark.parametrize("mode,estimator", [("quantile", "exact"), ("quantile", "histogram"), ("sign", "exact")])
def test_statistics_split_over_ranks_and_micro_batches_give_the_one_batch_bias(mode, estimator):
    scores = _skewed_scores(m=600)
    one = _balancer(mode, estimator)
    one.update(one.observe(scores, select_experts(scores, one.bias, 2)[0]))
    # DP=2, GA=1 (uneven halves) and DP=2 with GA=2 on rank 0: the same global batch in other pieces
    for parts in ([scores[:250], scores[250:]], [scores[:100], scores[100:300], scores[300:]]):
        bal = _balancer(mode, estimator)
        bal.update(_observe_parts(bal, parts))
        assert torch.equal(bal.bias, one.bias)


def test_eval_forward_returns_counts_only_and_moves_nothing():
    from model.moe.layer import LatentMoE

    cfg = K3Config.preset("tiny")
    moe = LatentMoE(cfg, 1)
    x = torch.randn(2, 8, cfg.hidden_size)
    _, stats = moe.eval()(x)
    assert stats.balance.margins_NE is None and int(stats.tokens_per_expert.sum()) == 16 * cfg.num_experts_per_token
    assert torch.equal(moe.gate.e_score_correction_bias, torch.zeros(cfg.num_experts))
    _, stats = moe.train()(x)
    assert stats.balance.margins_NE.shape == (16, cfg.num_experts)
    moe.balancer.update(stats.balance)
    assert not torch.equal(moe.gate.e_score_correction_bias, torch.zeros(cfg.num_experts))
