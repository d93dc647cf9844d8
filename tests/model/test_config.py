"""K3Config (issue 2 §4, docs/model.md §1/§9/§10 item 14): presets, the derived 3:1 schedule, HF config.json IO, and
one-line validation errors that name the key."""

from __future__ import annotations

import json

import pytest

from model.config import ConfigError, K3Config, a_log_storage_len, k3_schedule, preset_names
from model.vision.config import VisionConfig

K3_MLA_LAYERS = sorted({4 * k for k in range(1, 24)} | {93})  # 1-indexed, docs/model.md §1


# --- presets and the derived schedule -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "small", "k3"])
def test_every_preset_builds_and_is_listed(name: str) -> None:
    cfg = K3Config.preset(name)
    assert isinstance(cfg, K3Config) and name in preset_names()


def test_k3_preset_has_the_published_dims() -> None:
    c = K3Config.preset("k3")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.intermediate_size) == (163_840, 7168, 93, 33_792)
    assert (c.kda_num_heads, c.kda_head_dim, c.kda_conv_size) == (96, 128, 4)
    assert c.kda_gate_lower_bound == -5.0 and c.kda_use_full_rank_gate
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (96, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.mla_q_head_dim) == (128, 64, 128, 192)
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (896, 16, 2)
    assert (c.moe_intermediate_size, c.routed_expert_hidden_size, c.attn_res_block_size) == (3072, 3584, 12)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (163_584, 163_586, 163_839)
    assert not c.tie_word_embeddings and c.mla_use_output_gate and c.mla_use_nope


def test_k3_schedule_is_69_kda_and_24_mla_at_multiples_of_4_and_the_last_layer() -> None:
    c = K3Config.preset("k3")
    types = c.layer_types
    assert types.count("kda") == 69 and types.count("mla") == 24
    assert [i + 1 for i, t in enumerate(types) if t == "mla"] == K3_MLA_LAYERS
    assert c.linear_attn_config["full_attn_layers"] == K3_MLA_LAYERS
    assert c.linear_attn_config["kda_layers"] == [l for l in range(1, 94) if l not in K3_MLA_LAYERS]


def test_k3_layer_1_is_dense_and_layers_2_to_93_are_moe() -> None:
    c = K3Config.preset("k3")
    assert not c.is_moe_layer(0)
    assert all(c.is_moe_layer(i) for i in range(1, 93))


@pytest.mark.parametrize("name,mla", [("tiny", [4, 8]), ("small", [4, 8, 12, 16])])
def test_small_presets_follow_the_same_schedule(name: str, mla: list[int]) -> None:
    c = K3Config.preset(name)
    assert [i + 1 for i, t in enumerate(c.layer_types) if t == "mla"] == mla


def test_changing_depth_rederives_the_schedule() -> None:
    c = K3Config.preset("tiny", num_hidden_layers=10)
    assert c.linear_attn_config["full_attn_layers"] == [4, 8, 10]
    assert c.linear_attn_config["kda_layers"] == [1, 2, 3, 5, 6, 7, 9]
    assert k3_schedule(10) == ([1, 2, 3, 5, 6, 7, 9], [4, 8, 10])


def test_explicit_layer_lists_override_the_derived_schedule() -> None:
    c = K3Config.preset("tiny", linear_attn_config={"kda_layers": [1, 3, 4, 5, 7, 8], "full_attn_layers": [2, 6]})
    assert [i for i, t in enumerate(c.layer_types) if t == "mla"] == [1, 5]


def test_preset_overrides_merge_into_linear_attn_config() -> None:
    c = K3Config.preset("tiny", linear_attn_config={"gate_lower_bound": None})
    assert c.kda_gate_lower_bound is None and c.kda_num_heads == 4 and c.kda_head_dim == 64


def test_attn_res_disabled_by_zero_or_null() -> None:
    assert K3Config.preset("tiny").attn_res_enabled
    assert not K3Config.preset("tiny", attn_res_block_size=0).attn_res_enabled
    assert not K3Config.preset("tiny", attn_res_block_size=None).attn_res_enabled


def test_a_log_storage_is_padded_to_multiples_of_128() -> None:
    assert [a_log_storage_len(h) for h in (4, 96, 128, 129)] == [128, 128, 128, 256]


# --- HF config.json -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "small", "k3"])
def test_to_hf_config_round_trips_through_json(name: str) -> None:
    c = K3Config.preset(name)
    d = json.loads(json.dumps(c.to_hf_config()))
    assert d["model_type"] == ("kimi_k3" if c.vision_config is not None else "kimi_linear")  # k3: the release's
    assert K3Config.from_hf_config(d) == c


def test_save_then_load_from_directory_and_file_path(tmp_path) -> None:
    c = K3Config.preset("tiny", q_lora_rank=None, moe_balance="sign")
    c.save(tmp_path / "ckpt")
    assert K3Config.from_hf_config(tmp_path / "ckpt") == c
    assert K3Config.from_hf_config(str(tmp_path / "ckpt" / "config.json")) == c


def test_from_hf_config_reads_a_text_config_nested_file_and_ignores_foreign_keys(tmp_path) -> None:
    text = K3Config.preset("tiny").to_hf_config()
    text["linear_attn_config"] = {**text["linear_attn_config"], "some_future_key": 1}
    text["eos_token_id"] = [7, 8]
    nested = {
        "model_type": "kimi_k3",
        "vision_config": {"patch_size": 14, "model_type": "kimi_k3_vision"},
        "media_placeholder_token_id": 4095,
        "text_config": text,
        "unknown_top_level": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(nested))
    c = K3Config.from_hf_config(tmp_path / "config.json")
    tower = VisionConfig(patch_size=14, text_hidden_size=256)  # the tower's LM width defaults to the text config's
    assert c == K3Config.preset("tiny", eos_token_id=7, vision_config=tower, media_placeholder_token_id=4095)


def test_from_hf_config_reads_the_golden_tiny_checkpoint(golden_tiny_dir) -> None:
    raw = json.loads((golden_tiny_dir / "config.json").read_text())
    c = K3Config.from_hf_config(golden_tiny_dir)
    assert (c.hidden_size, c.vocab_size, c.kv_lora_rank, c.routed_expert_hidden_size) == (128, 512, 32, 64)
    assert [i + 1 for i, t in enumerate(c.layer_types) if t == "mla"] == [4, 8]
    out = c.to_hf_config()
    assert {k: out[k] for k in raw} == raw  # every released key survives a round trip unchanged


def test_from_hf_config_missing_path_is_a_one_line_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no config.json") as err:
        K3Config.from_hf_config(tmp_path / "nowhere")
    assert "\n" not in str(err.value)


# --- validation: one line, naming the key -------------------------------------------------------------------------

_POSITIVE_INT_KEYS = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "num_experts",
    "num_experts_per_token",
    "moe_intermediate_size",
    "routed_expert_hidden_size",
    "kda_chunk_size",
    "moe_balance_bins",
]

_BAD = [(dict(**{k: 0}), k) for k in _POSITIVE_INT_KEYS] + [
    (dict(qk_rope_head_dim=-1), "qk_rope_head_dim"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
    (dict(hidden_act="silu"), "hidden_act"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(mtp_depth=-1), "mtp_depth"),
    (dict(rms_norm_eps=-1e-5), "rms_norm_eps"),
    (dict(linear_attn_config={"head_dims": 64}), "linear_attn_config"),
    (dict(linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4, 8]}), "kda_layers"),
    (dict(linear_attn_config={"kda_layers": [1, 2, 3, 4, 5, 6, 7], "full_attn_layers": [4, 8]}), "full_attn_layers"),
    (dict(linear_attn_config={"num_heads": 0}), "num_heads"),
    (dict(linear_attn_config={"short_conv_kernel_size": 0}), "short_conv_kernel_size"),
    (dict(linear_attn_config={"gate_lower_bound": 1.0}), "gate_lower_bound"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(num_experts_per_token=9), "num_experts_per_token"),
    (dict(num_expert_group=3), "num_expert_group"),
    (dict(topk_group=2), "topk_group"),
    (dict(num_expert_group=4, topk_group=1, num_experts_per_token=3), "topk_group"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace"),
    (dict(moe_layer_freq=0), "moe_layer_freq"),
    (dict(attn_res_block_size=-1), "attn_res_block_size"),
    (dict(moe_balance="loss"), "moe_balance"),
    (dict(moe_balance_estimator="sketch"), "moe_balance_estimator"),
    (dict(bos_token_id=4096), "bos_token_id"),
    (dict(eos_token_id=-1), "eos_token_id"),
    (dict(pad_token_id=10**6), "pad_token_id"),
]


@pytest.mark.parametrize("overrides,key", _BAD, ids=[f"{k}-{i}" for i, (_, k) in enumerate(_BAD)])
def test_invalid_value_raises_one_line_config_error_naming_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        K3Config.preset("tiny", **overrides)
    msg = str(err.value)
    assert key in msg and "\n" not in msg


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="unknown model preset 'huge'.*tiny") as err:
        K3Config.preset("huge")
    assert "\n" not in str(err.value)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
