"""Muon (training/optim/muon.py): orthogonalisation maths against float64 references, DeepSpeed's muon_update
contract, parameter routing, and a tiny optimisation problem."""

from __future__ import annotations

import math

import pytest
import torch
from deepspeed.runtime.zero.muon import original_muon
from torch import nn

from training.config import TrainConfigError, build_model_config, compose, validate
from training.engine import build_ds_config
from training.optim.muon import Muon, block_scale, muon_param_groups, muon_update, newton_schulz, orthogonalise


def ns_reference(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton-Schulz on one matrix, float64, written out element by element of the recurrence."""
    x = g.double()
    t = x.shape[0] > x.shape[1]
    if t:
        x = x.T
    x = x / (math.sqrt(float((x * x).sum())) + 1e-7)
    for _ in range(steps):
        A = x @ x.T
        x = 3.4445 * x + (-4.7750 * A + 2.0315 * A @ A) @ x
    return x.T if t else x


def test_newton_schulz_maps_singular_values_near_one_for_odd_shapes():
    g = torch.randn(3, 7, 13, dtype=torch.float64)
    s = torch.linalg.svdvals(newton_schulz(g, steps=5))
    assert s.min() > 0.6 and s.max() < 1.25


def test_newton_schulz_keeps_singular_vectors_of_svd():
    g = torch.randn(9, 5, dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(g, full_matrices=False)
    o = newton_schulz(g, steps=5)
    d = U.T @ o @ Vh.T  # o = U diag(s') Vh with s' > 0: U^T o Vh^T is diagonal and positive
    off = d - torch.diag(torch.diagonal(d))
    assert off.abs().max() < 1e-10 and torch.diagonal(d).min() > 0.5


def test_fp32_newton_schulz_matches_float64_reference():
    g = torch.randn(11, 7)
    torch.testing.assert_close(newton_schulz(g, 5).double(), ns_reference(g, 5), rtol=0, atol=2e-5)


@pytest.mark.parametrize("rows,cols", [(12, 6), (6, 12), (7, 7)])
def test_block_scales_are_k2_rms_matching_and_deepspeeds_shape_rule(rows, cols):
    assert block_scale(rows, cols, "rms") == pytest.approx(0.2 * math.sqrt(max(rows, cols)), rel=1e-15)
    assert block_scale(rows, cols, "shape") == pytest.approx(math.sqrt(max(1.0, rows / cols)), rel=1e-15)


def test_rms_scale_gives_an_update_rms_near_adamws_0_2():
    o = orthogonalise(torch.randn(64, 256, dtype=torch.float64), None, 5, "rms")
    assert 0.15 < float(o.square().mean().sqrt()) < 0.25


def test_per_head_orthogonalisation_equals_loop_over_heads_in_float64():
    H, K, D = 3, 5, 11
    g = torch.randn(H * K, D)
    got = orthogonalise(g, heads=H, steps=5, scale="rms")
    ref = torch.cat([ns_reference(g[h * K : (h + 1) * K], 5) * 0.2 * math.sqrt(D) for h in range(H)])
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)
    assert (orthogonalise(g, heads=None, steps=5, scale="rms") - got).abs().max() > 1e-3  # not the whole-matrix map


def test_stacked_experts_orthogonalised_one_matrix_per_expert():
    g = torch.randn(4, 13, 6)
    got = orthogonalise(g, heads=None, steps=5, scale="shape")
    for e in range(4):
        torch.testing.assert_close(got[e].double(), ns_reference(g[e], 5) * (13 / 6) ** 0.5, rtol=0, atol=2e-5)


def test_muon_update_follows_deepspeeds_momentum_rule_per_head():
    g, m = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 5, dtype=torch.float64)
    m0 = m.clone()
    out = muon_update(g.clone(), m, beta=0.9, ns_steps=5, num_heads=2)
    torch.testing.assert_close(m, 0.9 * m0 + 0.1 * g, rtol=0, atol=1e-15)  # momentum.lerp(g, 1 - beta)
    nesterov = 0.1 * g + 0.9 * m  # g.lerp(momentum, beta)
    torch.testing.assert_close(out, orthogonalise(nesterov, 2, 5, "rms"), rtol=0, atol=1e-12)


def test_muon_update_keeps_momentum_on_a_non_finite_gradient():
    g, m = torch.randn(4, 4), torch.randn(4, 4)
    g[1, 2] = float("inf")
    m0 = m.clone()
    out = muon_update(g, m)
    assert torch.equal(m, m0) and not torch.isfinite(out).all()


def test_optimizer_installs_the_kernel_deepspeeds_zero_paths_import():
    Muon([{"params": [nn.Parameter(torch.zeros(3, 3))], "use_muon": True}], ns_steps=3, scale="shape")
    assert original_muon.muon_update is muon_update


def test_zero0_step_on_a_whole_matrix_is_the_per_head_update():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(6, 5))
    p.muon_num_heads = 3
    p.grad = torch.randn(6, 5)
    w0, g = p.detach().clone(), p.grad.clone()
    opt = Muon([{"params": [p], "use_muon": True, "lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}])
    opt.step()
    expected = w0 * (1 - 0.1 * 0.01) - 0.1 * orthogonalise(0.1 * g + 0.9 * (0.1 * g), 3, 5, "rms")
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)
    assert "momentum_buffer" in opt.state[p]


def test_flat_partition_step_applies_the_update_zero_already_wrote():
    p = nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    w0, u = p.detach().clone(), p.grad.clone()
    Muon([{"params": [p], "use_muon": True, "lr": 0.5, "weight_decay": 0.0}]).step()
    torch.testing.assert_close(p.detach(), w0 - 0.5 * u, rtol=0, atol=1e-7)


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    a, b = nn.Linear(5, 3), nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    opt_a = Muon([{"params": list(a.parameters()), "use_muon": False, "lr": 1e-2, "eps": 1e-8, "weight_decay": 0.1}])
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randn(8, 5)
    for _ in range(3):
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_muon_fits_a_tiny_linear_regression():
    torch.manual_seed(0)
    W_true = torch.randn(6, 8)
    x = torch.randn(256, 8)
    y = x @ W_true.T
    lin = nn.Linear(8, 6, bias=False)
    lin.weight.muon_num_heads = 2
    opt = Muon([{"params": [lin.weight], "use_muon": True, "lr": 0.05, "momentum": 0.9}], scale="shape")
    first = None
    for _ in range(200):
        opt.zero_grad()
        loss = (lin(x) - y).square().mean()
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.02 * first


def test_param_groups_route_heads_experts_and_adamw_parameters():
    from model.k3 import K3ForCausalLM

    cfg = compose(["experiment=tiny_ci", "optim=muon"])
    model = K3ForCausalLM(build_model_config(cfg))
    groups = muon_param_groups(model, 0.1, cfg)
    muon = {id(p) for g in groups if g["use_muon"] for p in g["params"]}
    heads = {n: getattr(p, "muon_num_heads", None) for n, p in model.named_parameters() if id(p) in muon}
    assert heads["model.layers.0.self_attn.q_proj.weight"] == 2  # KDA q/k/v per head
    assert heads["model.layers.0.self_attn.v_proj.weight"] == 2
    assert heads["model.layers.1.self_attn.q_b_proj.weight"] == 2  # MLA per head
    assert heads["model.layers.1.self_attn.kv_b_proj.weight"] == 2
    assert heads["model.layers.1.self_attn.o_proj.weight"] is None
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in heads
    experts = dict(model.named_parameters())["model.layers.1.block_sparse_moe.experts.w1"]
    assert id(experts) in muon and experts.is_expert_group
    for name in ("embed_tokens", "lm_head", "layernorm", "conv1d", "res_proj", "gate.weight", "A_log"):
        assert not any(name in n for n in heads), name
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_validates_with_every_zero_stage_and_ep(stage):
    validate(compose(["optim=muon", f"deepspeed=zero{stage}", "parallel=ep2"]), 2)


def test_muon_zero3_json_turns_off_reduce_scatter():
    cfg = compose(["optim=muon", "deepspeed=zero3"])
    assert build_ds_config(cfg, 2)["zero_optimization"]["reduce_scatter"] is False
    assert "reduce_scatter" not in build_ds_config(compose(["deepspeed=zero3"]), 2)["zero_optimization"]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["deepspeed=zero2_offload"], "cannot offload"),
        (["deepspeed=zero3_offload"], "cannot offload"),
        (["train.grad_clip=1.0"], "train.grad_clip=0"),
        (["deepspeed=zero3", "parallel=sp2"], "reduce_scatter"),
    ],
)
def test_muon_refusals_are_one_line(overrides, needle):
    with pytest.raises(TrainConfigError) as e:
        validate(compose(["optim=muon", *overrides]), 2)
    assert needle in str(e.value) and "\n" not in str(e.value)
