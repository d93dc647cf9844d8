"""Dropless dispatch + latent experts vs a naive per-token reference (fp64), hand-written backward vs autograd."""

from __future__ import annotations

import pytest
import torch

from model.config import K3Config
from model.moe.dispatch import LocalDispatcher, sort_by_expert
from model.moe.experts import LatentExperts

B1, B2 = 4.0, 25.0


def _experts(E=6, Im=10, l=7, **kw) -> LatentExperts:
    cfg = K3Config.preset(
        "tiny",
        num_experts=E,
        num_experts_per_token=min(3, E),
        moe_intermediate_size=Im,
        routed_expert_hidden_size=l,
        **kw,
    )
    ex = LatentExperts(cfg).double()
    with torch.no_grad():  # bigger weights so SiTU/cap leave their linear regime
        for w in (ex.w1, ex.w3, ex.w2):
            w.normal_(0, 0.7)
    return ex


def _expert_ref(ex: LatentExperts, j: int, z_L: torch.Tensor) -> torch.Tensor:
    """Obviously-correct fp64 E_j(z) for one token, straight from the formula of docs/model.md §5."""
    h1, h3 = ex.w1[j] @ z_L, ex.w3[j] @ z_L
    a = B1 * torch.tanh(h1 / B1) * torch.sigmoid(h1) * B2 * torch.tanh(h3 / B2)
    return ex.w2[j] @ a


def _moe_ref(z_NL, idx_NK, w_NK, ex):
    rows = []
    for n in range(z_NL.shape[0]):
        acc = torch.zeros_like(z_NL[n])
        for k in range(idx_NK.shape[1]):
            acc = acc + w_NK[n, k] * _expert_ref(ex, int(idx_NK[n, k]), z_NL[n])
        rows.append(acc)
    return torch.stack(rows)


def _routing(N, E, K, gen=None):
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    w = torch.rand(N, K, dtype=torch.float64, generator=gen)
    return idx, w


@pytest.mark.parametrize("N,K", [(1, 1), (13, 3), (29, 2)])
def test_dropless_matches_per_token_loop_fp64(N, K):
    ex = _experts()
    z = torch.randn(N, 7, dtype=torch.float64)
    idx, w = _routing(N, 6, K)
    torch.testing.assert_close(LocalDispatcher()(z, idx, w, ex), _moe_ref(z, idx, w, ex), rtol=1e-12, atol=1e-12)


def test_uneven_routing_most_tokens_to_one_expert_is_exact():
    ex = _experts(E=8)
    N, K = 40, 2
    z = torch.randn(N, 7, dtype=torch.float64)
    idx = torch.zeros(N, K, dtype=torch.long)
    idx[:, 1] = torch.where(torch.arange(N) < 3, torch.tensor(5), torch.tensor(1))  # experts 2,3,4,6,7 empty
    w = torch.rand(N, K, dtype=torch.float64)
    out = LocalDispatcher()(z, idx, w, ex)
    torch.testing.assert_close(out, _moe_ref(z, idx, w, ex), rtol=1e-12, atol=1e-12)
    _, _, counts = sort_by_expert(idx, 8)
    assert counts.tolist() == [40, 37, 0, 0, 0, 3, 0, 0] and int(counts.sum()) == N * K  # nothing dropped


def test_all_experts_equal_gives_expert_output_exactly():
    ex = _experts(E=5)
    with torch.no_grad():
        for w in (ex.w1, ex.w3, ex.w2):
            w.copy_(w[0:1].expand_as(w))
    z = torch.randn(17, 7, dtype=torch.float64)
    for K in (2, 3, 4):  # equal weights 1/K: whatever the tie-break, u = E(z) up to GEMM rounding
        idx, _ = _routing(17, 5, K)
        w = torch.full((17, K), 1.0 / K, dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(LocalDispatcher()(z, idx, w, ex), ex.expert(0, z), rtol=0, atol=1e-13)


@pytest.mark.parametrize("recompute", [True, False])
def test_custom_backward_matches_autograd_reference_fp64(recompute):
    ex = _experts()
    N, K = 19, 3
    z = torch.randn(N, 7, dtype=torch.float64, requires_grad=True)
    idx, w0 = _routing(N, 6, K)
    w = w0.clone().requires_grad_()
    g = torch.randn(N, 7, dtype=torch.float64)
    params = [z, w, ex.w1, ex.w3, ex.w2]
    got = torch.autograd.grad((LocalDispatcher(recompute)(z, idx, w, ex) * g).sum(), params)
    want = torch.autograd.grad((_moe_ref(z, idx, w, ex) * g).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recompute", [True, False])
def test_gradcheck_local_dispatch_tiny(recompute):
    ex = _experts(E=3, Im=4, l=3)
    z = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 2], [2, 1], [0, 1], [2, 0], [2, 1]])
    w = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    from model.moe.dispatch import _LocalMoE

    fn = lambda z_, w_, w1, w3, w2: _LocalMoE.apply(z_, w_, w1, w3, w2, idx, B1, B2, recompute)  # noqa: E731
    inputs = (
        z,
        w,
        ex.w1.detach().clone().requires_grad_(),
        ex.w3.detach().clone().requires_grad_(),
        ex.w2.detach().clone().requires_grad_(),
    )
    assert torch.autograd.gradcheck(fn, inputs)


def test_forward_grouped_matches_reference_and_gradcheck():
    ex = _experts(E=3, Im=4, l=3)
    counts = [2, 0, 3]
    z = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    owner = [0, 0, 2, 2, 2]
    ref = torch.stack([_expert_ref(ex, j, z[m]) for m, j in enumerate(owner)])
    torch.testing.assert_close(ex.forward_grouped(z, torch.tensor(counts)), ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda z_: ex.forward_grouped(z_, counts), (z,))
    g = torch.randn(5, 3, dtype=torch.float64)
    got = torch.autograd.grad((ex.forward_grouped(z, counts) * g).sum(), [ex.w1, ex.w3, ex.w2])
    want = torch.autograd.grad((ref * g).sum(), [ex.w1, ex.w3, ex.w2])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_forward_grouped_rejects_wrong_counts():
    ex = _experts(E=3)
    with pytest.raises(ValueError, match="counts_E must have 3 entries"):
        ex.forward_grouped(torch.randn(4, 7, dtype=torch.float64), [1, 1])


def test_saved_for_backward_is_inputs_not_activations():
    """Only z [N, l], the weights and the sort permutation are kept: no gathered copy, no GLU activations."""
    ex = _experts(E=4, Im=64, l=16)
    N, K = 50, 3
    z = torch.randn(N, 16, dtype=torch.float64, requires_grad=True)
    idx, w = _routing(N, 4, K)
    w.requires_grad_()
    saved: list[torch.Tensor] = []
    params = {ex.w1.data_ptr(), ex.w3.data_ptr(), ex.w2.data_ptr()}

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        LocalDispatcher()(z, idx, w, ex)
    saved_elems = sum(t.numel() for t in saved)
    assert saved_elems <= N * 16 + 3 * N * K  # z + weights + order + inverse
    assert saved_elems < N * K * 16  # less than one gathered copy


def test_bitwise_reproducible_and_recompute_mode_identical():
    ex = _experts()
    z = torch.randn(31, 7, dtype=torch.float64, requires_grad=True)
    idx, w = _routing(31, 6, 3)
    outs, grads = [], []
    for recompute in (True, True, False):
        out = LocalDispatcher(recompute)(z, idx, w, ex)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), [z, ex.w1]))
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert all(torch.equal(a, b) for g in grads for a, b in zip(g, grads[0]))


def test_local_dispatcher_refuses_partial_expert_set():
    cfg = K3Config.preset("tiny")
    ex = LatentExperts(cfg, num_local=4, expert_offset=4)
    with pytest.raises(ValueError, match="expert-parallel dispatcher"):
        LocalDispatcher()(
            torch.randn(2, cfg.routed_expert_hidden_size), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2), ex
        )


def test_bf16_path_runs_and_tracks_fp64():
    ex = _experts(E=4, Im=32, l=16)
    z = torch.randn(40, 16, dtype=torch.float64)
    idx, w = _routing(40, 4, 2)
    ref = LocalDispatcher()(z, idx, w, ex)
    ex_bf = _experts(E=4, Im=32, l=16)
    ex_bf.load_state_dict(ex.state_dict())
    ex_bf = ex_bf.to(torch.bfloat16)
    with torch.no_grad():
        out = LocalDispatcher()(z.to(torch.bfloat16), idx, w.float(), ex_bf)
        ref = ref.detach()
    assert out.dtype == torch.bfloat16
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 0.05


def test_expert_blocks_cover_every_row_once_in_order():
    from model.moe.experts import expert_blocks

    counts = [0, 5, 1, 0, 12, 2, 2, 7]
    blocks = expert_blocks(counts, block_rows=4)
    pieces = [(start + o, e, m, first) for start, rows, ps in blocks for e, o, m, first in ps]
    assert all(rows <= 4 and rows == sum(m for _, _, m, _ in ps) for _, rows, ps in blocks)
    assert [b[0] for b in blocks] == [sum(b[1] for b in blocks[:i]) for i in range(len(blocks))]  # contiguous
    row, seen = 0, set()
    for pos, e, m, first in pieces:  # consecutive rows; an expert's first piece is flagged, empty ones absent
        assert pos == row and m > 0 and first == (e not in seen)
        row, _ = row + m, seen.add(e)
    assert row == sum(counts)
    assert [sum(m for _, e2, m, _ in pieces if e2 == e) for e in range(len(counts))] == counts


def _assert_matches_reference(ex, idx: torch.Tensor, recompute: bool) -> None:
    """Output and every gradient (z, w, expert weights) of the local dispatcher equal the per-token reference."""
    N, K = idx.shape
    z = torch.randn(N, 7, dtype=torch.float64, requires_grad=True)
    w = torch.rand(N, K, dtype=torch.float64, requires_grad=True)
    g = torch.randn(N, 7, dtype=torch.float64)
    params = [z, w, ex.w1, ex.w3, ex.w2]
    out = LocalDispatcher(recompute)(z, idx, w, ex)
    ref = _moe_ref(z, idx, w, ex)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad((out * g).sum(), params), torch.autograd.grad((ref * g).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("recompute", [True, False])
def test_blocks_and_split_experts_match_reference_fp64(monkeypatch, recompute):
    """Tiny blocks: small experts share a block, the busy expert is split in pieces whose weight gradients
    accumulate; forward and every gradient still equal the per-token reference."""
    import model.moe.experts as experts_mod

    monkeypatch.setattr(experts_mod, "BLOCK_ROWS", 5)
    ex = _experts(E=6)
    N = 23
    idx = torch.stack([torch.zeros(N, dtype=torch.long), 1 + torch.arange(N) % 5], dim=1)  # expert 0: 23 rows
    _assert_matches_reference(ex, idx, recompute)


@pytest.mark.parametrize("recompute", [True, False])
def test_balanced_routing_grouped_bmm_path_matches_reference_fp64(monkeypatch, recompute):
    """Equal loads: blocks of equal-sized consecutive experts run their GEMMs as one bmm."""
    import model.moe.experts as experts_mod

    monkeypatch.setattr(experts_mod, "BLOCK_ROWS", 12)
    ex = _experts(E=6)
    N, K = 18, 2
    idx = (torch.arange(N).unsqueeze(1) * K + torch.arange(K)) % 6  # every expert exactly 6 rows
    idx = idx[torch.randperm(N)]
    blocks = experts_mod.expert_blocks([6] * 6)
    assert all(experts_mod._uniform(ps) is not None for _, _, ps in blocks)  # the bmm path is the one tested
    _assert_matches_reference(ex, idx, recompute)


def test_combine_sorted_is_bitwise_combine_slots_of_the_gathered_copy():
    """The local path combines slot by slot from the grouped rows; the all-to-all path gathers [N, K, l] first:
    both must give the same bits."""
    from model.moe.dispatch import combine_slots, combine_sorted, sum_sorted

    N, K, L = 37, 3, 16
    idx, w = _routing(N, 6, K)
    order, inverse, _ = sort_by_expert(idx, 6)
    y = torch.randn(N * K, L)
    inverse_KN = inverse.view(N, K).t().contiguous()
    gathered = y.index_select(0, inverse).view(N, K, L)
    assert torch.equal(combine_sorted(y, inverse_KN, w.float()), combine_slots(gathered, w.float()))
    want = gathered[:, 0].clone()
    for k in range(1, K):
        want.add_(gathered[:, k])
    assert torch.equal(sum_sorted(y, inverse_KN), want)
