"""LoRA adapters (model/lora.py): the functional op against a float64 reference, the zero-B start, the stacked
expert adapters against a per-expert reference, frozen base, merge."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from model import K3Config, K3ForCausalLM
from model.ffn import cap, situ
from model.lora import (
    LoRALinear,
    LoRASpec,
    adapter_state,
    apply_lora,
    is_adapter_param,
    lora_linear,
    merge_lora,
)
from model.moe.experts import LatentExperts

ALL = LoRASpec(
    rank=4,
    expert_rank=2,
    alpha=8.0,
    targets=("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    + ("gate_proj", "up_proj", "down_proj", "experts"),
)


def _config() -> K3Config:
    return K3Config.preset("tiny", num_hidden_layers=4, vocab_size=512)


def _randomise_adapters(model: torch.nn.Module, std: float = 0.05) -> None:
    with torch.no_grad():
        for _, p in adapter_state(model).items():
            p.normal_(0.0, std)


def test_lora_linear_matches_float64_reference_on_odd_shapes():
    x = torch.randn(3, 7, 13)
    w, a, b = torch.randn(11, 13), torch.randn(5, 13), torch.randn(11, 5)
    got = lora_linear(x, w, a, b, scale=0.7)
    ref = x.double() @ w.double().t() + 0.7 * (x.double() @ a.double().t()) @ b.double().t()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_zero_b_start_is_the_base_model_bitwise():
    torch.manual_seed(0)
    base = K3ForCausalLM(_config()).eval()
    adapted = copy.deepcopy(base)
    names = apply_lora(adapted, ALL)
    assert any(n.endswith(".experts") for n in names) and any(n.endswith("kv_b_proj") for n in names)
    ids = torch.randint(0, 512, (2, 19))
    with torch.no_grad():
        assert torch.equal(adapted(ids).logits, base(ids).logits)


def test_only_adapters_train():
    model = K3ForCausalLM(_config())
    apply_lora(model, ALL)
    ids = torch.randint(0, 512, (1, 16))
    model(ids, labels=ids).loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_param(n) for n in trainable)
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter_param(n))
    # B starts at zero, so A gets no gradient at step 0 but B does
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.endswith("lora_B.weight") and g.abs().sum() > 0 for n, g in grads.items())
    assert any(n.endswith("experts.lora.w2_B") and g.abs().sum() > 0 for n, g in grads.items())


def test_expert_adapters_match_per_expert_reference_in_float64():
    """Grouped experts with stacked adapters == each expert run alone with W + s B A, outputs and factor grads."""
    torch.manual_seed(1)
    cfg = _config()
    experts = LatentExperts(cfg).double()
    holder = torch.nn.Module()
    holder.experts = experts
    apply_lora(holder, LoRASpec(rank=4, expert_rank=3, alpha=6.0, targets=("experts",)))
    experts.double()
    _randomise_adapters(holder)
    counts = [3, 0, 5, 1, 2, 7, 0, 4]
    z = torch.randn(sum(counts), cfg.routed_expert_hidden_size, dtype=torch.float64, requires_grad=True)
    y = experts.forward_grouped(z, counts)
    g = torch.randn_like(y)
    got = torch.autograd.grad((y * g).sum(), [z, *experts.lora.parameters()])

    lora = experts.lora
    ref_rows, start = [], 0
    for j, m in enumerate(counts):
        w = {
            k: getattr(experts, k)[j] + lora.scale * getattr(lora, f"{k}_B")[j] @ getattr(lora, f"{k}_A")[j]
            for k in ("w1", "w3", "w2")
        }
        zj = z[start : start + m]
        a = situ(zj @ w["w1"].t(), experts.beta1) * cap(zj @ w["w3"].t(), experts.beta2)
        ref_rows.append(a @ w["w2"].t())
        start += m
    ref_y = torch.cat(ref_rows)
    ref = torch.autograd.grad((ref_y * g).sum(), [z, *lora.parameters()])
    torch.testing.assert_close(y, ref_y, rtol=1e-10, atol=1e-10)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_merge_gives_the_adapted_models_logits():
    """In float64: fp32 logits of the merged and the adapted model differ by summation order alone (~1e-5 through
    four layers, CPU-dependent), which would hide nothing and fail on some machines."""
    torch.manual_seed(2)
    model = K3ForCausalLM(_config()).eval()
    apply_lora(model, ALL)
    _randomise_adapters(model, std=0.01)  # an update of a fine-tune's size
    model.double()
    ids = torch.randint(0, 512, (2, 11))
    with torch.no_grad():
        want = model(ids).logits
        merged = merge_lora(copy.deepcopy(model))
        got = merged(ids).logits
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert set(merged.state_dict()) == set(K3ForCausalLM(_config()).state_dict())
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_unknown_target_refused_in_one_line():
    with pytest.raises(ValueError, match="lora.targets has unknown names") as e:
        apply_lora(K3ForCausalLM(_config()), LoRASpec(targets=("qproj",)))
    assert "\n" not in str(e.value)


def test_merged_expert_weights_are_not_kept_for_backward():
    """The expert node saves a recipe for the merged weights (recomputed in backward): after the forward no
    [E, Im, l] merged copy is alive, and backward still reaches the factors."""
    torch.manual_seed(3)
    cfg = _config()
    model = K3ForCausalLM(cfg)
    apply_lora(model, ALL)
    _randomise_adapters(model)
    moe = model.moe_layers()[0]
    made = []
    merge = moe.experts.weights

    def recording_weights():
        out = merge()
        made.extend(weakref.ref(t) for t in out)
        return out

    moe.experts.weights = recording_weights
    y, _ = moe(torch.randn(1, 9, cfg.hidden_size))
    gc.collect()
    assert len(made) == 3 and all(r() is None for r in made)
    y.sum().backward()
    assert moe.experts.lora.w1_A.grad is not None and moe.experts.lora.w1_A.grad.abs().sum() > 0
