"""The KDA layer: HF names and shapes, init, gate bounds, short conv, varlen resets, cached decoding
(docs/model.md §3, §10)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.config import K3Config
from model.hf import FP32_SUFFIXES, cast_model
from model.kda import KDA, KDACache
from model.kda.layer import causal_depthwise_conv

KDA_FP32 = [s for s in FP32_SUFFIXES if not s.startswith("gate.")]  # the KDA tensors the release keeps in fp32


def small_config(**lac) -> K3Config:
    return K3Config.preset(
        "tiny", hidden_size=32, linear_attn_config=dict(num_heads=2, head_dim=8, **lac), kda_chunk_size=16
    )


def make_layer(dtype=torch.float64, seed=0, **lac) -> KDA:
    torch.manual_seed(seed)
    layer = KDA(small_config(**lac), layer_idx=0).to(dtype)
    with torch.no_grad():  # a non-trivial output norm and a stronger decay than init, so the tests see them
        layer.o_norm.weight.uniform_(0.5, 1.5)
        layer.A_log.uniform_(-1.0, 1.0)
    return layer


def rand_x(B, T, d=32, dtype=torch.float64, seed=1):
    return torch.randn(B, T, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------------------------
# structure and init
# --------------------------------------------------------------------------------------------------------------
def test_parameters_have_hf_names_and_shapes():
    cfg = small_config()
    d, H, K, W = 32, 2, 8, cfg.kda_conv_size
    P = H * K
    shapes = {name: tuple(p.shape) for name, p in KDA(cfg, 0).named_parameters()}
    assert shapes == {
        "q_proj.weight": (P, d),
        "k_proj.weight": (P, d),
        "v_proj.weight": (P, d),
        "q_conv1d.weight": (P, 1, W),
        "k_conv1d.weight": (P, 1, W),
        "v_conv1d.weight": (P, 1, W),
        "A_log": (H,),
        "dt_bias": (P,),
        "f_a_proj.weight": (K, d),
        "f_b_proj.weight": (P, K),
        "b_proj.weight": (H, d),
        "g_proj.weight": (P, d),
        "o_norm.weight": (K,),
        "o_proj.weight": (d, P),
    }


def test_low_rank_output_gate_variant_has_kimi_linear_names():
    shapes = {n: tuple(p.shape) for n, p in KDA(small_config(use_full_rank_gate=False), 0).named_parameters()}
    assert "g_proj.weight" not in shapes
    assert shapes["g_a_proj.weight"] == (8, 32) and shapes["g_b_proj.weight"] == (16, 8)
    assert shapes["g_b_proj.bias"] == (16,)


def test_tiny_preset_parameter_count_matches_spec():
    layer = KDA(K3Config.preset("tiny"), 0)
    assert sum(p.numel() for p in layer.parameters()) == 364_868  # docs/model.md §9


def test_builds_on_meta_device():
    with torch.device("meta"):
        layer = KDA(K3Config.preset("k3"), 0)
    assert layer.q_proj.weight.is_meta and tuple(layer.A_log.shape) == (96,)
    assert sum(p.numel() for p in layer.parameters()) == 443_740_384  # docs/model.md §3


def test_init_follows_spec():
    torch.manual_seed(0)
    layer = KDA(K3Config.preset("tiny"), 0)
    assert torch.equal(layer.A_log, torch.zeros(4))
    dt = F.softplus(layer.dt_bias)
    assert dt.min() >= 1e-4 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert torch.equal(layer.o_norm.weight, torch.ones(64))
    assert abs(layer.q_proj.weight.std().item() - 0.02) < 2e-3
    for name in KDA_FP32:
        assert layer.get_parameter(name).dtype == torch.float32


# --------------------------------------------------------------------------------------------------------------
# gates and conv
# --------------------------------------------------------------------------------------------------------------
def _decay_for_extreme_inputs(layer: KDA) -> torch.Tensor:
    with torch.no_grad():
        layer.f_a_proj.weight.copy_(torch.eye(8, 32, dtype=layer.f_a_proj.weight.dtype))
        layer.f_b_proj.weight.fill_(1.0)
        layer.A_log.fill_(0.5)
    x = torch.zeros(1, 201, 32, dtype=torch.float32)
    x[0, :, 0] = torch.linspace(-1e4, 1e4, 201)  # z spans [-8e4, 8e4] (f_b sums the 8 latent channels)
    x[0, :, 1] = torch.linspace(-1e3, 1e3, 201)
    return layer.decay(x)


def test_decay_gate_is_bounded():
    g = _decay_for_extreme_inputs(KDA(small_config(), 0))
    assert g.dtype == torch.float32
    assert g.min() >= -5.0 and g.max() <= 0.0
    assert g.min() == -5.0  # the bound is reached (saturated) by huge inputs ...
    assert g.exp().min() >= math.exp(-5.0)  # ... so every step keeps at least e^-5 of the state


def test_kimi_linear_decay_gate_is_unbounded():
    g = _decay_for_extreme_inputs(KDA(small_config(gate_lower_bound=None), 0))
    assert g.max() <= 0.0 and g.min() < -1e3


def test_short_conv_matches_torch_causal_conv1d():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, bias=False, dtype=torch.float64)
    u = torch.randn(2, 11, 6, dtype=torch.float64)
    ref = conv(F.pad(u.transpose(1, 2), (3, 0))).transpose(1, 2)  # tap W-1 = current token
    assert torch.allclose(causal_depthwise_conv(u, conv.weight[:, 0]), ref, atol=1e-14, rtol=0)


# --------------------------------------------------------------------------------------------------------------
# sequences: causality, varlen, cache
# --------------------------------------------------------------------------------------------------------------
def test_output_at_t_ignores_later_tokens():
    layer = make_layer()
    x = rand_x(1, 40)
    y = layer(x)
    x2 = x.clone()
    x2[:, 25:] += 1.0
    y2 = layer(x2)
    assert torch.equal(y[:, :25], y2[:, :25])
    assert not torch.allclose(y[:, 25:], y2[:, 25:])


def test_varlen_layer_equals_separate_documents():
    """Packed documents reset both the recurrent state and the short-conv state at each boundary."""
    layer = make_layer()
    lengths = [7, 1, 30, 12]
    x = rand_x(1, sum(lengths))
    cu = torch.tensor([0, 7, 8, 38, 50], dtype=torch.int32)
    y = layer(x, cu_seqlens=cu)
    y_sep = torch.cat([layer(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    assert (y - y_sep).abs().max() <= 1e-12
    y_leaky = layer(x)  # without the boundaries the later documents see the earlier ones
    assert (y_leaky[:, 8:] - y_sep[:, 8:]).abs().max() > 1e-6


def test_split_sequence_with_carried_cache_equals_whole():
    layer = make_layer()
    x = rand_x(2, 45)
    y_full = layer(x)
    cache = KDACache()
    parts = [layer(x[:, :17], cache=cache), layer(x[:, 17:19], cache=cache), layer(x[:, 19:], cache=cache)]
    assert (torch.cat(parts, dim=1) - y_full).abs().max() <= 1e-12
    assert cache.seen_tokens == 45 and cache.recurrent_state.shape == (2, 2, 8, 8)
    assert cache.conv_state["q"].shape == (2, 3, 16)


def test_token_by_token_decode_equals_prefill():
    layer = make_layer()
    x = rand_x(1, 20)
    y_full = layer(x)
    cache = KDACache()
    y_prefill = layer(x[:, :12], cache=cache)
    steps = [layer(x[:, t : t + 1], cache=cache) for t in range(12, 20)]
    assert (torch.cat([y_prefill, *steps], dim=1) - y_full).abs().max() <= 1e-12


def test_bf16_layer_returns_bf16_and_keeps_fp32_params():
    layer = cast_model(make_layer(dtype=torch.float32), torch.bfloat16)  # as a bf16 load does
    assert all(layer.get_parameter(name).dtype == torch.float32 for name in KDA_FP32)
    x = rand_x(2, 19, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


def test_gradients_reach_every_parameter():
    layer = make_layer(dtype=torch.float32, gate_lower_bound=None, use_full_rank_gate=False)
    layer(rand_x(1, 33, dtype=torch.float32), cu_seqlens=torch.tensor([0, 20, 33])).square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_cache_with_cu_seqlens_raises():
    layer = make_layer()
    with pytest.raises(ValueError, match="not both"):
        layer(rand_x(1, 5), cu_seqlens=torch.tensor([0, 5]), cache=KDACache())


def test_wrong_hidden_size_raises():
    with pytest.raises(ValueError, match=r"KDA expects x \[B, T, 32\]"):
        make_layer()(torch.zeros(1, 4, 31, dtype=torch.float64))


def test_cu_seqlens_not_covering_the_sequence_raises():
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D cumulative lengths from 0 to T=5"):
        make_layer()(rand_x(1, 5), cu_seqlens=torch.tensor([0, 3]))
