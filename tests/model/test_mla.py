"""Gated NoPE MLA (docs/model.md §4, §10 items 6-8, 16): naive ≡ fp64 per-head oracle, absorbed ≡ naive (incl.
cached decode and chunked prefill), NoPE permutation invariance, causality, packed documents, output gate, shapes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from model.config import K3Config
from model.mla import MLA_LATENT_NORM_EPS, GatedMLA, MLACache

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def tiny_config(**overrides) -> K3Config:
    return K3Config.preset("tiny", **overrides)


def make_layer(dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> GatedMLA:
    """A layer with O(1) weights (fan-in scaled) and non-trivial norm scales, so attention is far from uniform and
    every term of the formula moves the output; the init of docs/model.md §4 (std 0.02) would make scores nearly
    flat."""
    torch.manual_seed(seed)
    layer = GatedMLA(tiny_config(**overrides), layer_idx=3)
    with torch.no_grad():
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, 1.5 / math.sqrt(m.in_features))
        for name, p in layer.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    return layer.to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def reference_mla(layer: GatedMLA, x_BTD: torch.Tensor, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """Slow float64 oracle written straight from docs/model.md §4: per token, per head, per key, explicit softmax."""
    W = {k: v.detach().double() for k, v in layer.state_dict().items()}
    H, dn, dr, dv, rkv = layer.num_heads, layer.nope_dim, layer.rope_dim, layer.v_dim, layer.kv_lora_rank
    x = x_BTD.detach().double()
    B, T, _ = x.shape
    cu = cu_seqlens or [0, T]
    doc = [next(i for i in range(len(cu) - 1) if cu[i] <= t < cu[i + 1]) for t in range(T)]

    def rms(v: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return w * v / torch.sqrt((v * v).mean() + eps)

    y = torch.zeros(B, T, x.shape[-1], dtype=torch.float64)
    for b in range(B):
        q, k, v = {}, {}, {}
        for t in range(T):
            xt = x[b, t]
            if layer.q_lora_rank is None:
                qt = W["q_proj.weight"] @ xt
            else:
                qt = W["q_b_proj.weight"] @ rms(W["q_a_proj.weight"] @ xt, W["q_a_layernorm.weight"], 1e-6)
            ckr = W["kv_a_proj_with_mqa.weight"] @ xt
            c_hat, k_r = rms(ckr[:rkv], W["kv_a_layernorm.weight"], 1e-6), ckr[rkv:]
            kv = W["kv_b_proj.weight"] @ c_hat
            for h in range(H):
                q[t, h] = qt[h * (dn + dr) : (h + 1) * (dn + dr)]
                rows = kv[h * (dn + dv) : (h + 1) * (dn + dv)]  # per-head rows [k_nope (dn); v (dv)]
                k[t, h] = torch.cat([rows[:dn], k_r])  # k_r shared by all heads, not rotated
                v[t, h] = rows[dn:]
        for t in range(T):
            keys = [s for s in range(t + 1) if doc[s] == doc[t]]
            heads = []
            for h in range(H):
                scores = [float(q[t, h] @ k[s, h]) / math.sqrt(dn + dr) for s in keys]
                m = max(scores)
                p = [math.exp(sc - m) for sc in scores]
                heads.append(sum(pi / sum(p) * v[s, h] for pi, s in zip(p, keys)))
            o = torch.cat(heads)
            if layer.use_output_gate:
                o = torch.sigmoid(W["g_proj.weight"] @ x[b, t]) * o
            y[b, t] = W["o_proj.weight"] @ o
    return y


# --- the formula --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides", [{}, {"q_lora_rank": None}, {"mla_use_output_gate": False}], ids=["q_lora", "plain_q_proj", "ungated"]
)
@pytest.mark.parametrize("absorbed", [False, True], ids=["naive", "absorbed"])
def test_forward_matches_fp64_reference(overrides: dict, absorbed: bool) -> None:
    layer = make_layer(**overrides)
    x = torch.randn(2, 11, layer.hidden_size, dtype=torch.float64)
    y = layer(x, absorbed=absorbed)
    assert rel_err(y, reference_mla(layer, x)) < 1e-12


def test_latent_norms_use_eps_1e6_not_rms_norm_eps() -> None:
    layer = make_layer()
    assert MLA_LATENT_NORM_EPS == 1e-6
    assert layer.q_a_layernorm.eps == 1e-6 and layer.kv_a_layernorm.eps == 1e-6


# --- absorbed ≡ naive ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_absorbed_equals_naive_full_sequence(dtype: torch.dtype) -> None:
    layer = make_layer(dtype)
    x = torch.randn(2, 37, layer.hidden_size, dtype=dtype)
    assert rel_err(layer(x, absorbed=True), layer(x, absorbed=False)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_cached_decode_token_by_token_equals_naive_forward(dtype: torch.dtype) -> None:
    layer = make_layer(dtype)
    x = torch.randn(2, 19, layer.hidden_size, dtype=dtype)
    cache = MLACache()
    y_steps = torch.cat([layer(x[:, t : t + 1], cache=cache) for t in range(x.shape[1])], dim=1)
    assert cache.c_kv.shape[1] == cache.k_r.shape[1] == 19
    assert rel_err(y_steps, layer(x, absorbed=False)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_chunked_prefill_then_decode_equals_naive_forward(dtype: torch.dtype) -> None:
    layer = make_layer(dtype)
    x = torch.randn(2, 23, layer.hidden_size, dtype=dtype)
    cache, outs, t = MLACache(), [], 0
    for n in (7, 1, 6, 1, 8):  # prefill, decode, chunk appended to a non-empty cache, ...
        outs.append(layer(x[:, t : t + n], cache=cache))
        t += n
    assert rel_err(torch.cat(outs, dim=1), layer(x, absorbed=False)) < TOL[dtype]


def test_cached_naive_equals_cached_absorbed() -> None:
    layer = make_layer()
    x = torch.randn(1, 12, layer.hidden_size, dtype=torch.float64)
    cache_a, cache_n = MLACache(), MLACache()
    for chunk in x.split([5, 1, 6], dim=1):
        y_a = layer(chunk, cache=cache_a, absorbed=True)
        y_n = layer(chunk, cache=cache_n, absorbed=False)
        assert rel_err(y_a, y_n) < 1e-12


def test_absorbed_gradients_equal_naive_gradients() -> None:
    layer = make_layer()
    x = torch.randn(1, 9, layer.hidden_size, dtype=torch.float64)
    grads = []
    for absorbed in (False, True):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        (layer(xi, absorbed=absorbed) ** 2).sum().backward()
        grads.append([xi.grad] + [p.grad.clone() for p in layer.parameters()])
    for g_naive, g_abs in zip(*grads):
        assert rel_err(g_abs, g_naive) < 1e-11


# --- the cache ----------------------------------------------------------------------------------------------------


def test_cache_holds_post_norm_latent_and_unrotated_shared_key() -> None:
    layer = make_layer()
    cfg = tiny_config()
    x = torch.randn(2, 5, layer.hidden_size, dtype=torch.float64)
    cache = MLACache()
    layer(x, cache=cache)
    c, k_r = layer.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    assert cache.c_kv.shape == (2, 5, cfg.kv_lora_rank) and cache.k_r.shape == (2, 5, cfg.qk_rope_head_dim)
    assert cache.c_kv.shape[-1] + cache.k_r.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    torch.testing.assert_close(cache.c_kv, layer.kv_a_layernorm(c), rtol=0, atol=1e-14)
    torch.testing.assert_close(cache.k_r, k_r, rtol=0, atol=1e-14)


def test_k3_cache_width_is_576_values_per_token() -> None:
    with torch.device("meta"):
        layer = GatedMLA(K3Config.preset("k3"), layer_idx=3)
        cache = MLACache()
        layer(torch.empty(1, 3, 7168), cache=cache)
    assert cache.c_kv.shape[-1] + cache.k_r.shape[-1] == 576
    assert tuple(cache.c_kv.shape) == (1, 3, 512) and tuple(cache.k_r.shape) == (1, 3, 64)


def test_cache_rejects_a_different_batch() -> None:
    layer = make_layer()
    cache = MLACache()
    layer(torch.randn(2, 3, layer.hidden_size, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match="batch"):
        layer(torch.randn(1, 1, layer.hidden_size, dtype=torch.float64), cache=cache)


# --- NoPE, causality, packing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("absorbed", [False, True], ids=["naive", "absorbed"])
def test_nope_output_at_t_invariant_to_permuting_earlier_positions(absorbed: bool) -> None:
    layer = make_layer()
    T, t = 15, 14
    x = torch.randn(1, T, layer.hidden_size, dtype=torch.float64)
    perm = torch.randperm(t)
    assert not torch.equal(perm, torch.arange(t))
    x_perm = torch.cat([x[:, perm], x[:, t:]], dim=1)
    y, y_perm = layer(x, absorbed=absorbed), layer(x_perm, absorbed=absorbed)
    torch.testing.assert_close(y_perm[:, t], y[:, t], rtol=0, atol=1e-12)
    assert (y_perm[:, 1:t] - y[:, 1:t]).abs().max() > 1e-3  # earlier outputs do see the order (causal prefixes)


@pytest.mark.parametrize("absorbed", [False, True], ids=["naive", "absorbed"])
def test_perturbing_future_tokens_leaves_earlier_outputs_unchanged(absorbed: bool) -> None:
    layer = make_layer()
    T, t = 16, 9
    x = torch.randn(2, T, layer.hidden_size, dtype=torch.float64)
    x2 = x.clone()
    x2[:, t + 1 :] += torch.randn_like(x2[:, t + 1 :])
    y, y2 = layer(x, absorbed=absorbed), layer(x2, absorbed=absorbed)
    torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], rtol=0, atol=1e-14)
    assert (y2[:, t + 1 :] - y[:, t + 1 :]).abs().min() > 0


@pytest.mark.parametrize("absorbed", [False, True], ids=["naive", "absorbed"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_varlen_cu_seqlens_equals_separate_sequences(absorbed: bool, cu_dtype: torch.dtype) -> None:
    layer = make_layer()
    lengths = [5, 1, 9, 0, 4]
    x = torch.randn(1, sum(lengths), layer.hidden_size, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=cu_dtype)
    y_packed = layer(x, cu_seqlens=cu, absorbed=absorbed)
    y_sep = torch.cat([layer(part, absorbed=absorbed) for part in x.split(lengths, dim=1) if part.shape[1]], dim=1)
    torch.testing.assert_close(y_packed, y_sep, rtol=0, atol=1e-12)


def test_packed_attention_memory_is_linear_in_the_packed_length() -> None:
    """Packed documents on CPU must not keep a [T, T] mask / probability matrix for backward."""
    layer = make_layer(torch.float32)

    def saved_bytes(T: int) -> int:
        sizes: list[int] = []
        x = torch.randn(1, T, layer.hidden_size, requires_grad=True)
        cu = torch.arange(0, T + 1, 64)  # documents of 64 tokens
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.nbytes) or t, lambda t: t):
            layer(x, cu_seqlens=cu)
        return sum(sizes)

    assert saved_bytes(1024) < 5 * saved_bytes(256)  # 4x the tokens: ~4x the bytes (a T x T matrix would be 16x)


def test_varlen_matches_fp64_reference() -> None:
    layer = make_layer()
    cu = [0, 4, 11, 13]
    x = torch.randn(1, 13, layer.hidden_size, dtype=torch.float64)
    y = layer(x, cu_seqlens=torch.tensor(cu))
    assert rel_err(y, reference_mla(layer, x, cu)) < 1e-12


# --- the output gate ----------------------------------------------------------------------------------------------


def test_zero_gate_weight_halves_the_ungated_output() -> None:
    gated = make_layer()
    ungated = make_layer(mla_use_output_gate=False)
    state = {k: v for k, v in gated.state_dict().items() if not k.startswith("g_proj.")}
    ungated.load_state_dict(state)
    with torch.no_grad():
        gated.g_proj.weight.zero_()
    x = torch.randn(2, 10, gated.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(gated(x), 0.5 * ungated(x), rtol=0, atol=1e-14)


# --- structure, init, dtypes, errors ------------------------------------------------------------------------------


def test_parameter_names_and_shapes_follow_hf_keys() -> None:
    cfg = tiny_config()
    d, H, dn, dr, dv, rq, rkv = 256, 4, 32, 16, 32, 128, 64
    expected = {
        "q_a_proj.weight": (rq, d),
        "q_a_layernorm.weight": (rq,),
        "q_b_proj.weight": (H * (dn + dr), rq),
        "kv_a_proj_with_mqa.weight": (rkv + dr, d),
        "kv_a_layernorm.weight": (rkv,),
        "kv_b_proj.weight": (H * (dn + dv), rkv),
        "o_proj.weight": (d, H * dv),
        "g_proj.weight": (H * dv, d),
    }
    got = {k: tuple(v.shape) for k, v in GatedMLA(cfg, 3).state_dict().items()}
    assert got == expected
    plain = {k: tuple(v.shape) for k, v in GatedMLA(tiny_config(q_lora_rank=None), 3).state_dict().items()}
    assert plain["q_proj.weight"] == (H * (dn + dr), d)
    assert not any(k.startswith(("q_a_", "q_b_")) for k in plain)


@pytest.mark.parametrize("preset,expected", [("tiny", 159_936), ("small", 2_556_544), ("k3", 232_196_096)])
def test_parameter_count_per_layer_matches_spec(preset: str, expected: int) -> None:
    with torch.device("meta"):
        layer = GatedMLA(K3Config.preset(preset), layer_idx=3)
    assert sum(p.numel() for p in layer.parameters()) == expected


def test_init_is_normal_with_initializer_range_and_unit_norms() -> None:
    torch.manual_seed(1)
    layer = GatedMLA(tiny_config(initializer_range=0.05), layer_idx=3)
    for name, p in layer.named_parameters():
        if name.endswith("layernorm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert abs(p.std().item() - 0.05) < 0.005 and abs(p.mean().item()) < 0.005, name


def test_bf16_forward_keeps_dtype_shape_and_tracks_fp32() -> None:
    layer = make_layer(torch.float32)
    x = torch.randn(2, 13, layer.hidden_size)
    y32 = layer(x)
    layer_bf = make_layer(torch.float32).to(torch.bfloat16)
    y_bf = layer_bf(x.to(torch.bfloat16))
    assert y_bf.dtype == torch.bfloat16 and y_bf.shape == (2, 13, layer.hidden_size)
    assert rel_err(y_bf, y32) < 5e-2
    cache = MLACache()
    y_dec = torch.cat([layer_bf(x[:, t : t + 1].to(torch.bfloat16), cache=cache) for t in range(13)], dim=1)
    assert y_dec.dtype == torch.bfloat16 and cache.c_kv.dtype == torch.bfloat16
    assert rel_err(y_dec, y32) < 5e-2


@pytest.mark.parametrize(
    "case,match",
    [
        ("wrong_width", "expects x of shape"),
        ("batch_with_cu", "batch size 1"),
        ("cu_and_cache", "both cu_seqlens and cache"),
        ("cu_not_ending_at_T", "rise from 0 to T"),
        ("cu_float", "int32/int64"),
    ],
)
def test_bad_input_raises_one_line_error(case: str, match: str) -> None:
    layer = make_layer()
    d = layer.hidden_size
    x = torch.randn(1, 6, d, dtype=torch.float64)
    cu = torch.tensor([0, 2, 6])
    call = {
        "wrong_width": lambda: layer(torch.randn(1, 6, d + 1, dtype=torch.float64)),
        "batch_with_cu": lambda: layer(torch.randn(2, 6, d, dtype=torch.float64), cu_seqlens=cu),
        "cu_and_cache": lambda: layer(x, cu_seqlens=cu, cache=MLACache()),
        "cu_not_ending_at_T": lambda: layer(x, cu_seqlens=torch.tensor([0, 2, 5])),
        "cu_float": lambda: layer(x, cu_seqlens=cu.float()),
    }[case]
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


def test_golden_checkpoint_mla_tensors_load_strictly(golden_tiny_dir) -> None:
    from safetensors.torch import load_file

    cfg = K3Config.from_hf_config(golden_tiny_dir)
    prefix = "language_model.model.layers.3.self_attn."
    weights = {
        k[len(prefix) :]: v for k, v in load_file(golden_tiny_dir / "model.safetensors").items() if k.startswith(prefix)
    }
    layer = GatedMLA(cfg, layer_idx=3)
    layer.load_state_dict(weights, strict=True)  # names and shapes are exactly the released ones
    layer.double()
    x = torch.randn(1, 7, cfg.hidden_size, dtype=torch.float64)
    assert rel_err(layer(x), reference_mla(layer, x)) < 1e-12
