"""FLOPs-per-token formula, MFU definition and the peak-FLOP/s probe/cache."""

from __future__ import annotations

import json

import pytest

from model.config import K3Config
from training.metrics import flops as F
from training.metrics import system


def test_training_flops_are_three_times_forward():
    cfg = K3Config.preset("tiny")
    assert F.flops_per_token(cfg, 256, training=True) == pytest.approx(3 * F.flops_per_token(cfg, 256, training=False))


def test_mla_attention_term_counts_causal_query_key_pairs():
    cfg = K3Config.preset("tiny")
    T = 37
    pairs = sum(t + 1 for t in range(T))  # query t attends keys 0..t
    per_pair = 2 * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    n_mla = cfg.layer_types.count("mla")
    assert F.flops_breakdown(cfg, T)["mla_attention"] == pytest.approx(n_mla * per_pair * pairs / T)


def test_only_the_mla_attention_term_depends_on_seq_len():
    cfg = K3Config.preset("small")
    a, b = F.flops_breakdown(cfg, 512), F.flops_breakdown(cfg, 4096)
    assert {k for k in a if a[k] != b[k]} == {"mla_attention"}


def test_all_kda_model_has_flops_independent_of_seq_len():
    cfg = K3Config.preset("tiny", linear_attn_config=dict(kda_layers=list(range(1, 9)), full_attn_layers=[]))
    assert F.flops_per_token(cfg, 64) == F.flops_per_token(cfg, 65_536)


def _spec_non_matmul_active(c: K3Config) -> int:
    """Active parameters that are not multiplied with a token vector (docs/model.md §8 terms)."""
    n_kda, n_mla = c.layer_types.count("kda"), c.layer_types.count("mla")
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    P = c.kda_num_heads * c.kda_head_dim
    kda = c.kda_num_heads + P + c.kda_head_dim  # A_log, dt_bias, o_norm
    mla = c.q_lora_rank + c.kv_lora_rank  # q_a / kv_a norms
    moe = c.num_experts + c.routed_expert_hidden_size  # router bias, latent norm
    norms_res = c.num_hidden_layers * 6 * c.hidden_size + 3 * c.hidden_size
    return n_kda * kda + n_mla * mla + n_moe * moe + norms_res


@pytest.mark.parametrize("preset,active", [("k3", 104_189_612_640), ("small", 125_083_048), ("tiny", 6_895_568)])
def test_matmul_params_are_published_active_params_minus_norms_and_biases(preset, active):
    cfg = K3Config.preset(preset)
    assert F.matmul_params_active(cfg) == active - _spec_non_matmul_active(cfg)


def test_matmul_flops_are_twice_matmul_params():
    cfg = K3Config.preset("k3")
    br = F.flops_breakdown(cfg, 4096)
    mm = sum(v for k, v in br.items() if k in ("kda_proj", "mla_proj", "dense_ffn", "moe", "lm_head"))
    assert mm == 2 * F.matmul_params_active(cfg)


def test_attn_res_mixture_sizes_follow_the_block_algorithm():
    k3 = F.attn_res_sizes(K3Config.preset("k3")).layers
    assert max(max(p) for p in k3) == 9  # 7 full blocks + partial + embedding (docs/model.md §6)
    tiny = F.attn_res_sizes(K3Config.preset("tiny")).layers
    assert tiny[0] == (0, 2) and max(max(p) for p in tiny) == 4  # docs/model.md §9: 4 candidates
    off = F.attn_res_sizes(K3Config.preset("tiny", attn_res_block_size=0))
    assert all(p == (0, 0) for p in off.layers) and off.output == 0


def test_mfu_is_achieved_model_flops_over_peak():
    assert F.mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    assert F.mfu(1000.0, 6e9, 0.0) == 0.0


def test_peak_flops_is_measured_once_then_read_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("K3_PEAK_FLOPS", raising=False)
    calls = []
    real = system.measure_matmul_flops
    monkeypatch.setattr(system, "measure_matmul_flops", lambda *a, **k: calls.append(1) or real(128, 2))
    first = system.peak_flops("cpu")
    second = system.peak_flops("cpu")
    assert first == second > 0 and len(calls) == 1
    stored = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(stored.values()) == [first]


def test_peak_flops_env_override_and_gpu_table(monkeypatch):
    monkeypatch.setenv("K3_PEAK_FLOPS", "1.5e12")
    assert system.peak_flops("cpu") == 1.5e12
    assert system.gpu_peak_flops("NVIDIA H200") == 989e12
    assert system.gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert system.gpu_peak_flops("Some Unknown Accelerator") is None


def test_measured_matmul_rate_is_plausible():
    rate = system.measure_matmul_flops(256, 3)
    assert 1e8 < rate < 1e15


def test_memory_stats_reports_process_rss():
    m = system.memory_stats("cpu")
    assert m["memory/rss_gib"] > 0.01


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_matmul_params_equal_the_real_models_matrices(preset):
    """Every >= 2-D parameter a token meets (embedding table and AttnRes pseudo-queries aside; k of E experts)."""
    from model.params import build_meta

    cfg = K3Config.preset(preset)
    model = build_meta(cfg)
    total = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() >= 2 and "embed_tokens" not in n and "_res_proj" not in n
    )
    inactive = sum(
        (cfg.num_experts - cfg.num_experts_per_token)
        * sum(getattr(m.experts, w)[0].numel() for w in ("w1", "w2", "w3"))
        for m in model.moe_layers()
    )
    assert F.matmul_params_active(cfg) == total - inactive
