"""`train.precision=bf16` as on the GPU (issue 35 part 4): the model in bf16 keeps every numerically sensitive place in
fp32, and a bf16 config DeepSpeed cannot train with fp32 master weights is refused before it starts. The loss curve
against fp32 is measured by bench/bf16.py (docs/performance.md)."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import K3ForCausalLM
from tests.model.micro import exercise_every_path, micro_config
from training.config import TrainConfigError, compose, validate
from training.engine import build_ds_config

# ops whose precision matters: exponentials, normalisers, gates, accumulations
SENSITIVE = {"sigmoid", "_softmax", "_log_softmax", "exp", "logsumexp", "rsqrt", "softplus", "silu", "cumsum", "tanh"}
FUSED_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"}
# place -> (the module it runs in, the ops that must be seen there in >= fp32)
FP32_PLACES = {
    "router scores (sigmoid of the fp32 router GEMM)": ({"Router"}, {"sigmoid", "mm"}),
    "SiTU-GLU of the dense FFN": ({"SiTUGLU"}, {"sigmoid"}),
    "SiTU-GLU of the routed experts": ({"LatentMoE", "LatentExperts", "MXFP4Experts"}, {"sigmoid"}),
    "MLA output gate": ({"GatedMLA"}, {"sigmoid"}),
    "KDA decay, beta and gates": ({"KDA"}, {"sigmoid", "exp", "cumsum"}),
    "RMSNorm statistics": ({"RMSNorm"}, {"rsqrt"}),
    "Attention Residuals softmax over blocks": ({"K3DecoderLayer", "K3Model"}, {"_softmax"}),
    "loss (log-sum-exp of the logits)": ({"K3ForCausalLM"}, {"logsumexp"}),
}


class Precision(TorchDispatchMode):
    """Records (innermost module, op, input float dtypes) of every forward op; modules tracked by hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.seen: collections.Counter = collections.Counter()
        self.hooks = []
        for m in model.modules():
            self.hooks.append(m.register_forward_pre_hook(self._enter))
            self.hooks.append(m.register_forward_hook(self._leave))

    def _enter(self, mod: torch.nn.Module, *_) -> None:
        self.stack.append(type(mod).__name__)

    def _leave(self, *_) -> None:
        self.stack.pop()  # returns None: the module's output stays

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stack:
            dts = tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point)
            self.seen[(self.stack[-1], func._schema.name.split("::")[-1], dts)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def bf16_run():
    """The micro model cut to 3 layers (KDA 1-2, MLA 3, MoE 2-3) cast to bf16 as DeepSpeed's bf16 mode does
    (`module.bfloat16()`), one packed row of two documents, forward + backward under the recorder."""
    cfg = micro_config(
        num_hidden_layers=3, linear_attn_config=dict(num_heads=2, head_dim=16, kda_layers=[1, 2], full_attn_layers=[3])
    )
    torch.manual_seed(0)
    model = exercise_every_path(K3ForCausalLM(cfg)).bfloat16().train()
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    rec = Precision(model)
    with rec:
        out = model(ids, labels=ids, cu_seqlens=torch.tensor([0, 19, 40]))
    out.loss.backward()
    return model, out, rec


def test_weights_and_gradients_are_bf16_and_the_router_bias_stays_fp32(bf16_run):
    model, _, _ = bf16_run
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.bfloat16}
    biases = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and {b.dtype for b in biases} == {torch.float32}


def test_activations_between_layers_are_bf16(bf16_run):
    _, _, rec = bf16_run
    mm = [dts for (where, op, dts) in rec.seen if op in ("mm", "addmm", "bmm") and where not in ("Router",)]
    assert mm and sum(all(d == torch.bfloat16 for d in dts) for dts in mm) >= len(mm) // 2


@pytest.mark.parametrize("place", list(FP32_PLACES))
def test_each_fp32_place_runs_in_fp32(bf16_run, place):
    _, _, rec = bf16_run
    modules, ops = FP32_PLACES[place]
    got = {(op, dts) for (where, op, dts) in rec.seen if where in modules and op in ops}
    assert {op for op, _ in got} == ops, f"{place}: expected ops {ops} in {modules}, saw {sorted(got)}"
    assert all(d in (torch.float32, torch.float64) for _, dts in got for d in dts), (place, sorted(got))


def test_no_sensitive_op_runs_in_bf16_and_attention_is_a_fused_fp32_softmax_kernel(bf16_run):
    """Everywhere in the forward, not only the named places; MLA's softmax runs inside a fused SDPA kernel, which
    accumulates and normalises bf16 inputs in fp32, or as an explicit fp32 `_softmax`."""
    _, out, rec = bf16_run
    low = sorted({(w, op) for (w, op, dts) in rec.seen if op in SENSITIVE and torch.bfloat16 in dts})
    assert not low, low
    attention = {op for (w, op, _) in rec.seen if w == "GatedMLA"}
    assert attention & FUSED_ATTENTION
    assert out.loss.dtype == torch.float32


def test_bf16_with_zero0_is_refused_in_one_line_and_zero1_gets_fp32_master_and_accumulation():
    with pytest.raises(TrainConfigError, match="deepspeed=zero0") as e:
        validate(compose(["train.precision=bf16", "deepspeed=zero0"]), world_size=1)
    assert "\n" not in str(e.value)
    ds = build_ds_config(compose(["train.precision=bf16", "deepspeed=zero1"]), world_size=1)
    assert ds["bf16"] == {"enabled": True} and ds["data_types"] == {"grad_accum_dtype": "fp32"}
