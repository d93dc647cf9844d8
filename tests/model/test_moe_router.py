"""Router (docs/model.md §5, §10 item 9): sigmoid scores, bias-corrected selection, unbiased renormalised weights."""

from __future__ import annotations

import torch

from model.config import K3Config
from model.moe.router import Router, select_experts


def _cfg(**kw) -> K3Config:
    base = dict(
        hidden_size=32, num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, routed_expert_hidden_size=24
    )
    base.update(kw)
    return K3Config.preset("tiny", **base)


def test_equal_scores_give_uniform_weights_one_over_k():
    for k in (1, 2, 3, 8):
        r = Router(_cfg(num_experts_per_token=k)).double()
        torch.nn.init.zeros_(r.weight)
        route = r(torch.randn(11, 32, dtype=torch.float64))
        torch.testing.assert_close(route.weight_NK, torch.full((11, k), 1.0 / k, dtype=torch.float64))


def test_ties_break_towards_lower_expert_id():
    r = Router(_cfg(num_experts_per_token=3))
    torch.nn.init.zeros_(r.weight)
    route = r(torch.randn(5, 32))
    assert route.expert_idx_NK.tolist() == [[0, 1, 2]] * 5


def test_bias_changes_selection_only():
    r = Router(_cfg(num_experts_per_token=2)).double()
    x = torch.randn(64, 32, dtype=torch.float64)
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 5.0, 0, 5.0]))
    route = r(x)
    assert route.expert_idx_NK.sort(-1).values.tolist() == [[5, 7]] * 64  # bias forces the choice
    s = torch.sigmoid(x @ r.weight.t()).detach()
    chosen = s.gather(1, route.expert_idx_NK)  # unbiased scores of the selected experts
    torch.testing.assert_close(route.weight_NK, chosen / chosen.sum(-1, keepdim=True))


def test_weights_sum_to_one_times_scaling():
    x = torch.randn(33, 32, dtype=torch.float64)
    r = Router(_cfg(num_experts_per_token=3)).double()
    torch.testing.assert_close(r(x).weight_NK.sum(-1), torch.ones(33, dtype=torch.float64))
    r2 = Router(_cfg(num_experts_per_token=3, routed_scaling_factor=2.5)).double()
    r2.load_state_dict(r.state_dict())
    torch.testing.assert_close(r2(x).weight_NK.sum(-1), torch.full((33,), 2.5, dtype=torch.float64))


def test_without_renormalize_weights_are_raw_scores():
    x = torch.randn(9, 32, dtype=torch.float64)
    r = Router(_cfg(moe_renormalize=False)).double()
    route = r(x)
    torch.testing.assert_close(route.weight_NK, route.scores_NE.gather(1, route.expert_idx_NK))


def test_router_reads_full_width_and_scores_in_fp32():
    cfg = _cfg()
    r = Router(cfg).to(torch.bfloat16)
    assert r.weight.shape == (cfg.num_experts, cfg.hidden_size)
    assert r.e_score_correction_bias.dtype == torch.float32
    route = r(torch.randn(4, cfg.hidden_size, dtype=torch.bfloat16))
    assert route.scores_NE.dtype == torch.float32 and route.weight_NK.dtype == torch.float32


def test_bias_is_persistent_buffer_without_grad():
    r = Router(_cfg())
    assert "e_score_correction_bias" in r.state_dict()
    assert all(p is not r.e_score_correction_bias for p in r.parameters())


def _grouped_reference(biased: torch.Tensor, k: int, groups: int, topk_group: int) -> list[list[int]]:
    """Per-token loop: group score = sum of top-2, keep the best groups (lower id on ties), top-k inside."""
    N, E = biased.shape
    per = E // groups
    out = []
    for n in range(N):
        row = biased[n].tolist()
        gscore = [sum(sorted(row[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        keep = sorted(range(groups), key=lambda g: (-gscore[g], g))[:topk_group]
        cand = [e for e in range(E) if e // per in keep]
        out.append(sorted(cand, key=lambda e: (-row[e], e))[:k])
    return out


def test_grouped_topk_matches_per_token_reference():
    torch.manual_seed(1)
    scores = torch.rand(50, 16, dtype=torch.float64)
    bias = torch.randn(16, dtype=torch.float64) * 0.1
    idx, w = select_experts(scores, bias, k=3, num_groups=4, topk_group=2)
    assert idx.tolist() == _grouped_reference(scores + bias, 3, 4, 2)
    per_group = idx // 4
    assert all(len(set(row)) <= 2 for row in per_group.tolist())


def test_grouped_topk_via_config():
    r = Router(_cfg(num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2)).double()
    x = torch.randn(20, 32, dtype=torch.float64)
    route = r(x)
    assert route.expert_idx_NK.tolist() == _grouped_reference(route.scores_NE.detach(), 4, 4, 2)


def test_weight_gradient_flows_through_unbiased_scores_only():
    r = Router(_cfg()).double()
    x = torch.randn(6, 32, dtype=torch.float64)
    route = r(x)
    (route.weight_NK[:, 0].sum()).backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    assert r.e_score_correction_bias.grad is None
