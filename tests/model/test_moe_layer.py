"""LatentMoE as a whole (docs/model.md §5, §10 items 9-10): the composed formula, latent norm, shapes, stats,
meta build."""

from __future__ import annotations

import torch

from model.config import K3Config
from model.moe.layer import LatentMoE

B1, B2 = 4.0, 25.0


def _cfg(**kw) -> K3Config:
    base = dict(
        hidden_size=24,
        num_experts=6,
        num_experts_per_token=3,
        num_shared_experts=2,
        moe_intermediate_size=10,
        routed_expert_hidden_size=8,
    )
    base.update(kw)
    return K3Config.preset("tiny", **base)


def _glu(x, wg, wu, wd):
    g, u = x @ wg.t(), x @ wu.t()
    return (B1 * torch.tanh(g / B1) * torch.sigmoid(g) * B2 * torch.tanh(u / B2)) @ wd.t()


def _reference(moe: LatentMoE, x_ND: torch.Tensor) -> torch.Tensor:
    """docs/model.md §5 (report Eq. 11) token by token in fp64."""
    ex, E, K = moe.experts, moe.num_experts, moe.top_k
    out = []
    for x in x_ND:
        s = torch.sigmoid(moe.gate.weight @ x)
        biased = (s + moe.gate.e_score_correction_bias.double()).tolist()
        I = sorted(range(E), key=lambda j: (-biased[j], j))[:K]
        p = s[I] / s[I].sum()
        z = moe.routed_expert_down_proj.weight @ x
        u = sum(p[k] * _glu(z, ex.w1[j], ex.w3[j], ex.w2[j]) for k, j in enumerate(I))
        u = u / torch.sqrt((u * u).mean() + moe.routed_expert_norm.eps) * moe.routed_expert_norm.weight
        sh = moe.shared_experts
        out.append(
            moe.routed_expert_up_proj.weight @ u + _glu(x, sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight)
        )
    return torch.stack(out)


def test_layer_matches_spec_formula_fp64():
    moe = LatentMoE(_cfg(), layer_idx=1).double()
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.1)
        moe.gate.weight.normal_(0, 0.5)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    y, _ = moe(x)
    torch.testing.assert_close(y, _reference(moe, x.view(14, 24)).view(2, 7, 24), rtol=1e-10, atol=1e-12)


def test_latent_norm_makes_output_invariant_to_latent_scale():
    """W_up RMSNorm(c u) = W_up RMSNorm(u) for c > 0: scaling every expert's W2 by c scales u by c."""
    moe = LatentMoE(_cfg(rms_norm_eps=1e-12), 1).double()
    with torch.no_grad():  # O(1) latents so that eps is negligible
        for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2, moe.routed_expert_down_proj.weight):
            w.normal_(0, 0.5)
    x = torch.randn(1, 9, 24, dtype=torch.float64)
    y0, _ = moe(x)
    with torch.no_grad():
        moe.experts.w2.mul_(37.0)
    y1, _ = moe(x)
    torch.testing.assert_close(y1, y0, rtol=1e-9, atol=1e-12)


def test_router_sees_width_d_and_experts_width_l():
    cfg = _cfg()
    moe = LatentMoE(cfg, 1)
    d, l, E, Im = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    assert moe.gate.weight.shape == (E, d)
    assert moe.experts.w1.shape == (E, Im, l) and moe.experts.w3.shape == (E, Im, l)
    assert moe.experts.w2.shape == (E, l, Im)
    assert moe.routed_expert_down_proj.weight.shape == (l, d) and moe.routed_expert_up_proj.weight.shape == (d, l)
    assert moe.routed_expert_norm.weight.shape == (l,)
    assert moe.shared_experts.gate_proj.weight.shape == (2 * Im, d)


def test_equal_scores_and_equal_experts_give_expert_of_latent():
    """W_r = 0, b = 0 (p = 1/k) and identical experts: the routed latent is E(z) whatever the tie-break."""
    cfg = _cfg(num_experts_per_token=2, num_shared_experts=0, latent_moe_use_norm=False)
    moe = LatentMoE(cfg, 1).double()
    with torch.no_grad():
        moe.gate.weight.zero_()
        for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
            w.copy_(w[0:1].expand_as(w))
        x = torch.randn(1, 5, 24, dtype=torch.float64)
        y, _ = moe(x)
        z = x.view(5, 24) @ moe.routed_expert_down_proj.weight.t()
        torch.testing.assert_close(
            y.view(5, 24), moe.experts.expert(0, z) @ moe.routed_expert_up_proj.weight.t(), rtol=0, atol=1e-13
        )


def test_router_stats_count_every_assignment():
    cfg = _cfg()
    moe = LatentMoE(cfg, 3)
    _, stats = moe(torch.randn(3, 11, 24))
    assert stats.tokens_per_expert.dtype == torch.int64 and stats.tokens_per_expert.shape == (cfg.num_experts,)
    assert int(stats.tokens_per_expert.sum()) == 33 * cfg.num_experts_per_token
    assert stats.num_tokens == 33 and stats.layer_idx == 3 and stats.aux_loss is None


def test_backward_reaches_every_parameter():
    moe = LatentMoE(_cfg(), 1)
    y, _ = moe(torch.randn(2, 16, 24))
    y.square().sum().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_no_shared_experts_and_no_latent_norm_drop_their_keys():
    moe = LatentMoE(_cfg(num_shared_experts=0, latent_moe_use_norm=False), 1)
    keys = set(moe.state_dict())
    assert not any(k.startswith(("shared_experts", "routed_expert_norm")) for k in keys)
    y, _ = moe(torch.randn(1, 4, 24))
    assert y.shape == (1, 4, 24)


def test_bf16_module_keeps_fp32_bias_and_runs():
    moe = LatentMoE(_cfg(), 1).to(torch.bfloat16)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    y, _ = moe(torch.randn(2, 5, 24, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


def test_k3_layer_builds_on_meta_with_exact_param_count():
    with torch.device("meta"):
        moe = LatentMoE(K3Config.preset("k3"), 1)
    n = sum(p.numel() for p in moe.parameters()) + moe.gate.e_score_correction_bias.numel()
    assert n == 29_784_936_832  # docs/model.md §8: MoE layer total incl. the router bias
    assert moe.experts.w1.is_meta


def test_tiny_and_small_layer_param_counts():
    for name, want in (("tiny", 657_544), ("small", 11_231_648)):  # docs/model.md §9 per-layer MoE counts
        with torch.device("meta"):
            moe = LatentMoE(K3Config.preset(name), 1)
        assert sum(p.numel() for p in moe.parameters()) + moe.num_experts == want, name
