"""The grouped_mm expert backend (model/moe/grouped.py) computes what the loop backend computes: values and
gradients, zero-token experts, LoRA and MXFP4 experts; `model.expert_backend` selects it at run time."""

from __future__ import annotations

import pytest
import torch

from model.k3 import K3ForCausalLM
from model.moe.dispatch import LocalDispatcher
from model.moe.grouped import grouped_mm_ok, resolve_backend
from model.moe.layer import LatentMoE
from tests.model.micro import micro_config


def _moe(dtype: torch.dtype, **overrides) -> LatentMoE:
    torch.manual_seed(0)
    cfg = micro_config(num_experts=8, num_experts_per_token=2, **overrides)
    return LatentMoE(cfg, layer_idx=0).to(dtype).train()


def _run(moe: LatentMoE, backend: str, x: torch.Tensor, idx=None):
    """Output and the gradients of every parameter and of x, under `backend`."""
    moe.dispatcher = LocalDispatcher(backend=backend)
    moe.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    if idx is not None:  # fixed routing (e.g. experts left without tokens)
        moe.gate.forward = lambda x_ND: _fixed(moe, x_ND, idx)  # type: ignore[method-assign]
    y, _ = moe(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


def _fixed(moe, x_ND, idx_NK):
    from model.moe.router import Routing

    s = moe.gate.scores(x_ND)
    w = s.gather(1, idx_NK)
    return Routing(s, idx_NK, w / w.sum(-1, keepdim=True))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_grouped_mm_backend_equals_loop_backend(dtype, tol):
    moe = _moe(dtype)
    x = torch.randn(2, 13, moe.routed_expert_down_proj.in_features, dtype=dtype)  # odd row count
    y_loop, gx_loop, g_loop = _run(moe, "loop", x)
    y_gmm, gx_gmm, g_gmm = _run(moe, "grouped_mm", x)
    torch.testing.assert_close(y_gmm, y_loop, atol=tol, rtol=0)
    torch.testing.assert_close(gx_gmm, gx_loop, atol=tol, rtol=0)
    assert g_gmm.keys() == g_loop.keys()
    for name in g_loop:
        torch.testing.assert_close(g_gmm[name], g_loop[name], atol=tol, rtol=0, msg=name)


def test_fp32_runs_on_grouped_mm_itself_and_fp64_on_the_documented_fallback():
    assert grouped_mm_ok(torch.zeros(1, dtype=torch.float32), 16, 16)
    assert not grouped_mm_ok(torch.zeros(1, dtype=torch.float64), 16, 16)
    assert not grouped_mm_ok(torch.zeros(1, dtype=torch.float32), 18, 16)  # 72-byte rows: not 16-byte aligned


def test_zero_token_experts_get_zero_gradients():
    moe = _moe(torch.float32)
    x = torch.randn(1, 9, moe.routed_expert_down_proj.in_features)
    idx = torch.tensor([[1, 4]] * 9)  # experts 0, 2, 3, 5, 6, 7 receive nothing
    _, _, g_loop = _run(moe, "loop", x, idx)
    _, _, g_gmm = _run(moe, "grouped_mm", x, idx)
    for w in ("w1", "w3", "w2"):
        g = g_gmm[f"experts.{w}"]
        assert g[[0, 2, 3, 5, 6, 7]].abs().max() == 0
        assert g[[1, 4]].abs().max() > 0
        torch.testing.assert_close(g, g_loop[f"experts.{w}"], atol=1e-6, rtol=0)


def test_lora_and_mxfp4_experts_take_the_grouped_backend():
    from model.lora import LoRASpec, apply_lora
    from model.moe.mxfp4_experts import to_mxfp4_

    for prepare in ("lora", "mxfp4"):
        moe = _moe(torch.float32, moe_intermediate_size=32, routed_expert_hidden_size=32)  # MXFP4: blocks of 32
        if prepare == "lora":
            apply_lora(moe, LoRASpec(rank=2, expert_rank=2, alpha=4.0, targets=("experts",)))
            with torch.no_grad():
                for n, p in moe.named_parameters():
                    if "lora" in n:
                        p.normal_(std=0.1)
        else:
            to_mxfp4_(moe.experts)
        x = torch.randn(1, 11, moe.routed_expert_down_proj.in_features)
        y_loop, gx_loop, g_loop = _run(moe, "loop", x)
        y_gmm, gx_gmm, g_gmm = _run(moe, "grouped_mm", x)
        torch.testing.assert_close(y_gmm, y_loop, atol=1e-6, rtol=0)
        torch.testing.assert_close(gx_gmm, gx_loop, atol=1e-6, rtol=0)
        for name in g_loop:
            torch.testing.assert_close(g_gmm[name], g_loop[name], atol=1e-6, rtol=0, msg=f"{prepare}: {name}")


def test_expert_backend_is_a_runtime_choice_validated_by_name():
    assert resolve_backend("auto", torch.device("cpu")) == "loop"
    assert resolve_backend("auto", torch.device("cuda")) == "grouped_mm"
    model = K3ForCausalLM(micro_config())
    model.set_expert_backend("grouped_mm")
    moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
    assert moes and all(m.dispatcher.backend == "grouped_mm" for m in moes)
    assert "expert_backend" not in model.config.to_hf_config()  # never in the exported config.json
    with pytest.raises(ValueError, match="auto\\|grouped_mm\\|loop"):
        model.set_expert_backend("cutlass")


def test_unknown_expert_backend_fails_at_validation_in_one_line():
    from training.config import TrainConfigError, compose, validate

    with pytest.raises(TrainConfigError, match="model.expert_backend must be auto\\|grouped_mm\\|loop"):
        validate(compose(["model.expert_backend=cutlass"]), 1)
    validate(compose(["model.expert_backend=grouped_mm"]), 1)  # a valid name composes and validates
