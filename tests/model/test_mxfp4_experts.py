"""Frozen MXFP4 experts (model/moe/mxfp4_experts.py, lora.base_experts=mxfp4): the quantiser against its slow
reference, the MXFP4 model against the fp32 model built from the dequantised weights (bitwise: dequantisation
is exact and the same GEMMs run), codes as buffers, gradients only into adapters, no dequantised copy kept."""

from __future__ import annotations

import copy
import gc
import weakref

import torch

from model import K3Config, K3ForCausalLM
from model.lora import LoRASpec, adapter_state, apply_lora, is_adapter_param, merge_lora
from model.moe.mxfp4_experts import MXFP4Experts
from model.mxfp4 import dequantize_mxfp4, dequantize_stacked, pack_mxfp4, quantize_mxfp4_reference

SPEC = dict(rank=4, expert_rank=2, alpha=8.0)


def _config() -> K3Config:
    return K3Config.preset("tiny", num_hidden_layers=4, vocab_size=512)


def _pair(seed: int = 0, std: float = 0.05):
    """(MXFP4 LoRA model, the same LoRA model over fp32 experts holding the dequantised codes), same adapters."""
    torch.manual_seed(seed)
    base = K3ForCausalLM(_config())
    q = copy.deepcopy(base)
    apply_lora(q, LoRASpec(**SPEC, base_experts="mxfp4"))
    ref = copy.deepcopy(base)
    apply_lora(ref, LoRASpec(**SPEC))
    with torch.no_grad():
        for mq, mr in zip(q.moe_layers(), ref.moe_layers()):
            for w in ("w1", "w3", "w2"):
                getattr(mr.experts, w).copy_(mq.experts.base_weight(w))
        for n, p in adapter_state(q).items():
            p.normal_(0.0, std)
            adapter_state(ref)[n].copy_(p)
    return q, ref


def test_quantiser_equals_its_reference_and_decodes_to_the_nearest_grid_value():
    torch.manual_seed(0)
    w = torch.randn(6, 64) * torch.logspace(-3, 2, 6).unsqueeze(1)
    w[0, :32] = 0.0  # an all-zero group
    w[1, 5] = 0.75 * 2.0 ** torch.ceil(torch.log2(w[1, :32].abs().max() / 6))  # a tie between 0.5 and 1
    packed, scale = pack_mxfp4(w)
    codes, exps = quantize_mxfp4_reference(w)
    p = packed.to(torch.int64)
    assert torch.stack([p & 0xF, p >> 4], -1).reshape(-1).tolist() == codes
    assert scale.reshape(-1).tolist() == exps
    deq = dequantize_mxfp4(packed, scale)
    step = 2.0 ** (scale.to(torch.float64) - 127).repeat_interleave(32, 1)  # the grid's widest gap is 2 * 2^e
    assert ((deq.double() - w.double()).abs() <= step + 1e-12).all()
    assert torch.equal(pack_mxfp4(deq)[0], packed) or torch.equal(dequantize_mxfp4(*pack_mxfp4(deq)), deq)


def test_codes_are_buffers_not_parameters():
    model = K3ForCausalLM(_config())
    apply_lora(model, LoRASpec(**SPEC, base_experts="mxfp4"))
    experts = model.moe_layers()[0].experts
    assert isinstance(experts, MXFP4Experts)
    names = {n for n, _ in experts.named_parameters(recurse=False)}
    assert not names & {"w1", "w3", "w2"}
    assert experts.w1_packed.dtype == torch.uint8 and experts.w1_scale.dtype == torch.uint8
    cfg = _config()
    assert experts.shape_of("w1") == (cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size)
    assert not any(".w1_packed" in k for k in model.state_dict())  # never checkpointed


def test_mxfp4_forward_equals_the_model_of_the_dequantised_weights_bitwise():
    q, ref = _pair()
    ids = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        assert torch.equal(q(ids).logits, ref(ids).logits)


def test_zero_b_first_forward_equals_the_dequantised_base():
    torch.manual_seed(1)
    base = K3ForCausalLM(_config()).eval()
    q = copy.deepcopy(base)
    apply_lora(q, LoRASpec(**SPEC, base_experts="mxfp4"))
    with torch.no_grad():
        for mb, mq in zip(base.moe_layers(), q.moe_layers()):
            for w in ("w1", "w3", "w2"):
                getattr(mb.experts, w).copy_(mq.experts.base_weight(w))
    ids = torch.randint(0, 512, (2, 13))
    with torch.no_grad():
        assert torch.equal(q.eval()(ids).logits, base(ids).logits)


def test_gradients_reach_only_adapters_and_equal_the_dense_models():
    q, ref = _pair(2)
    ids = torch.randint(0, 512, (1, 16))
    q(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    got = {n: p.grad for n, p in q.named_parameters() if p.grad is not None}
    assert got and all(is_adapter_param(n) for n in got)
    assert any(".experts.lora." in f".{n}" for n in got)
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for n in got:
        assert torch.equal(got[n], want[n]), n


def test_dequantised_experts_are_not_kept_for_backward():
    torch.manual_seed(3)
    cfg = _config()
    model = K3ForCausalLM(cfg)
    apply_lora(model, LoRASpec(**SPEC, base_experts="mxfp4"))
    moe = model.moe_layers()[0]
    made = []
    dequantise = moe.experts.base_weight

    def recording(w):
        out = dequantise(w)
        made.append(weakref.ref(out))
        return out

    moe.experts.base_weight = recording
    y, _ = moe(torch.randn(1, 9, cfg.hidden_size))
    gc.collect()
    assert len(made) == 3 and all(r() is None for r in made)
    y.sum().backward()  # backward dequantises again
    assert len(made) > 3 and moe.experts.lora.w2_B.grad.abs().sum() > 0


def test_merge_makes_dense_experts_equal_to_the_merged_dense_model():
    """merge_lora of the MXFP4 model == merge_lora of the dense model of the dequantised weights, bitwise (the
    merge's own error against the adapted model is tests/model/test_lora.py's)."""
    q, ref = _pair(4)
    ids = torch.randint(0, 512, (2, 11))
    with torch.no_grad():
        merged = merge_lora(copy.deepcopy(q)).eval()
        assert not any(isinstance(m, MXFP4Experts) for m in merged.modules())
        assert torch.equal(merged(ids).logits, merge_lora(ref).eval()(ids).logits)


def test_stacked_dequantisation_is_per_expert_dequantisation():
    w = torch.randn(3, 8, 64)
    packed, scale = zip(*(pack_mxfp4(x) for x in w))
    got = dequantize_stacked(torch.stack(packed), torch.stack(scale), torch.float32)
    for j in range(3):
        assert torch.equal(got[j], dequantize_mxfp4(packed[j], scale[j]))
