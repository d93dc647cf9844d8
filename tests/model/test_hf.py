"""HF checkpoint IO (issue 3 §4): key names, prefixes, padded A_log, MXFP4 experts, sharding, strictness."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.config import K3Config, a_log_storage_len
from model.hf import CheckpointError, cast_model, load_hf_checkpoint, read_hf_state, save_hf_checkpoint
from model.k3 import K3ForCausalLM
from model.mxfp4 import E2M1_VALUES, dequantize_mxfp4, pack_mxfp4
from tests.model.micro import micro_config as shared_micro_config


def micro_config(**overrides) -> K3Config:
    """The shared micro config with wider experts (MXFP4 packs groups of 32 columns)."""
    return shared_micro_config(**{**dict(moe_intermediate_size=32, routed_expert_hidden_size=32), **overrides})


def randomised(cfg: K3Config) -> K3ForCausalLM:
    """A model whose every tensor (zero-init queries, router bias included) holds distinct random values."""
    m = K3ForCausalLM(cfg)
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) * 0.1)
    return m


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


# --- MXFP4 --------------------------------------------------------------------------------------------------------


def test_mxfp4_low_nibble_is_the_even_column_and_sign_is_bit_3():
    packed = torch.tensor([[0x21] + [0x00] * 15, [0x9F] + [0x00] * 15], dtype=torch.uint8)  # [2, 16] -> 32 cols
    scale = torch.tensor([[127], [128]], dtype=torch.uint8)  # 2^0, 2^1
    w = dequantize_mxfp4(packed, scale, torch.float64)
    assert w.shape == (2, 32)
    assert w[0, :2].tolist() == [0.5, 1.0]  # 0x21: low nibble 1 -> col 0 = 0.5, high nibble 2 -> col 1 = 1.0
    assert w[1, :2].tolist() == [-12.0, -1.0]  # 0xF -> -6 * 2, 0x9 -> -0.5 * 2
    assert (w[:, 2:] == 0).all()


def test_mxfp4_grid_values_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (6, 64), generator=g)
    exps = torch.randint(-10, 5, (6, 2), generator=g)
    vals = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)[codes]
    vals[:, ::32] = 6.0  # each group reaches the top code so the chosen scale is the generating one
    w = vals * torch.pow(2.0, exps.double()).repeat_interleave(32, dim=1)
    packed, scale = pack_mxfp4(w)
    assert packed.shape == (6, 32) and scale.shape == (6, 2) and packed.dtype == scale.dtype == torch.uint8
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float64), w)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16).double(), w)


def test_mxfp4_quantisation_error_is_within_half_a_step():
    w = torch.randn(8, 96, dtype=torch.float64)
    packed, scale = pack_mxfp4(w)
    deq = dequantize_mxfp4(packed, scale, torch.float64)
    step = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)  # grid spacing <= 2 * scale
    assert ((deq - w).abs() <= step + 1e-12).all()
    assert (deq.sign() * w.sign() >= 0).all()


def test_mxfp4_rejects_mismatched_scale():
    with pytest.raises(ValueError, match="weight_scale shape"):
        dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


# --- round trip, layout -------------------------------------------------------------------------------------------


def test_round_trip_is_exact(tmp_path):
    cfg = micro_config()
    m = randomised(cfg)
    save_hf_checkpoint(m, tmp_path)
    loaded = load_hf_checkpoint(tmp_path)
    assert_same_state(m, loaded)
    assert loaded.config == cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    assert torch.equal(m.eval()(ids).logits, loaded.eval()(ids).logits)


def test_saved_keys_are_hf_names_with_per_expert_tensors_and_padded_a_log(tmp_path):
    cfg = micro_config()
    m = randomised(cfg)
    save_hf_checkpoint(m, tmp_path)
    state = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    assert not any(k.endswith(("experts.w1", "experts.w2", "experts.w3")) for k in state)
    E, Im, l = cfg.num_experts, cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
    for j in range(E):
        assert state[f"model.layers.1.block_sparse_moe.experts.{j}.w1.weight"].shape == (Im, l)
        assert state[f"model.layers.1.block_sparse_moe.experts.{j}.w2.weight"].shape == (l, Im)
    H = cfg.kda_num_heads
    a = state["model.layers.0.self_attn.A_log"]
    assert a.shape == (a_log_storage_len(H),) == (128,)
    assert torch.equal(a[:H], m.model.layers[0].self_attn.A_log.detach()) and (a[H:] == 0).all()
    with open(os.path.join(tmp_path, "config.json")) as f:
        assert json.load(f)["num_experts"] == E


def test_sharded_save_writes_an_index_and_loads_back(tmp_path):
    m = randomised(micro_config())
    names = save_hf_checkpoint(m, tmp_path, max_shard_bytes=40_000)
    assert len(names) > 1 and not os.path.exists(tmp_path / "model.safetensors")
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(names)
    assert_same_state(m, load_hf_checkpoint(tmp_path))


def test_released_prefix_nested_config_and_mxfp4_experts_load(tmp_path):
    cfg = micro_config()
    m = randomised(cfg)
    save_hf_checkpoint(m, tmp_path / "plain")
    state = load_file(str(tmp_path / "plain" / "model.safetensors"))
    released: dict[str, torch.Tensor] = {}
    expected_experts = {}
    for k, t in state.items():
        if ".experts." in k:  # release: MXFP4 pairs only
            packed, scale = pack_mxfp4(t)
            released["language_model." + k.replace(".weight", ".weight_packed")] = packed
            released["language_model." + k.replace(".weight", ".weight_scale")] = scale
            expected_experts[k] = dequantize_mxfp4(packed, scale, t.dtype)
        else:
            released["language_model." + k] = t
    out = tmp_path / "release"
    out.mkdir()
    save_file(released, str(out / "model.safetensors"))
    with open(out / "config.json", "w") as f:
        json.dump({"model_type": "kimi_k3", "text_config": cfg.to_hf_config()}, f)  # (vision: test_vision_hf.py)
    loaded = load_hf_checkpoint(out)
    assert loaded.config == cfg
    moe = loaded.model.layers[1].block_sparse_moe
    for j in range(cfg.num_experts):
        for w in ("w1", "w2", "w3"):
            expected = expected_experts[f"model.layers.1.block_sparse_moe.experts.{j}.{w}.weight"]
            assert torch.equal(getattr(moe.experts, w)[j], expected)
    assert torch.equal(loaded.lm_head.weight, m.lm_head.weight)
    assert torch.equal(loaded.model.layers[0].self_attn.A_log, m.model.layers[0].self_attn.A_log)


def test_unknown_and_missing_keys_are_listed_unless_not_strict(tmp_path):
    m = randomised(micro_config())
    save_hf_checkpoint(m, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.norm.weight"]
    state["model.layers.0.bogus.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"unknown keys \[model\.layers\.0\.bogus\.weight\].*"
        r"missing keys \[model\.norm\.weight\]",
    ):
        load_hf_checkpoint(tmp_path)
    loose = load_hf_checkpoint(tmp_path, strict=False)
    assert torch.equal(loose.lm_head.weight, m.lm_head.weight)
    assert torch.equal(loose.model.norm.weight, torch.ones_like(loose.model.norm.weight))  # fresh init


def test_shape_mismatch_names_the_key(tmp_path):
    save_hf_checkpoint(randomised(micro_config()), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(7,\)"):
        load_hf_checkpoint(tmp_path)


def test_pickle_checkpoints_are_refused(tmp_path):
    micro_config().save(tmp_path)
    torch.save({"lm_head.weight": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_hf_checkpoint(tmp_path)


def test_requested_dtype_keeps_the_spec_fp32_tensors(tmp_path):
    save_hf_checkpoint(randomised(micro_config()), tmp_path)
    m = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    kda, moe = m.model.layers[0].self_attn, m.model.layers[1].block_sparse_moe
    for t in (
        kda.q_conv1d.weight,
        kda.k_conv1d.weight,
        kda.v_conv1d.weight,
        kda.A_log,
        kda.dt_bias,
        kda.o_norm.weight,
        moe.gate.e_score_correction_bias,
    ):
        assert t.dtype == torch.float32
    assert kda.q_proj.weight.dtype == moe.experts.w1.dtype == m.lm_head.weight.dtype == torch.bfloat16
    c = cast_model(randomised(micro_config()), torch.bfloat16)
    assert c.model.layers[0].self_attn.A_log.dtype == torch.float32 and c.lm_head.weight.dtype == torch.bfloat16


def test_golden_tiny_key_set_matches_the_model(golden_tiny_dir):
    """Every released-layout key of the shared tiny checkpoint maps onto a model tensor and vice versa."""
    cfg = K3Config.from_hf_config(golden_tiny_dir)
    hf = read_hf_state(golden_tiny_dir)
    with torch.device("meta"):
        m = K3ForCausalLM(cfg)
    ours = set()
    for name, t in m.state_dict().items():
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            prefix, w = name.rsplit(".", 1)
            ours |= {f"{prefix}.{j}.{w}.weight" for j in range(t.shape[0])}
        else:
            ours.add(name)
    assert ours == set(hf)
