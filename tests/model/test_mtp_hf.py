"""MTP blocks in HF checkpoints: DeepSeek-V3's `model.layers.{L+k-1}.*` names, exact round trip, and a model
without MTP loading an MTP checkpoint says so in one line."""

from __future__ import annotations

import json
import logging

import torch
from safetensors import safe_open

from model.hf import load_hf_checkpoint, save_hf_checkpoint
from model.k3 import K3ForCausalLM
from tests.model.micro import exercise_every_path, micro_config


def saved(tmp_path, depth: int = 2) -> K3ForCausalLM:
    torch.manual_seed(0)
    model = exercise_every_path(K3ForCausalLM(micro_config(mtp_depth=depth)))
    save_hf_checkpoint(model, tmp_path)
    return model


def test_mtp_blocks_are_saved_under_deepseek_v3_layer_names(tmp_path):
    saved(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    for k in (5, 6):  # L = 5: depths 1, 2
        assert {f"model.layers.{k}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj")} <= keys
        assert f"model.layers.{k}.self_attn.kv_b_proj.weight" in keys
        assert f"model.layers.{k}.block_sparse_moe.experts.0.w1.weight" in keys
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 2


def test_mtp_checkpoint_round_trip_is_bitwise(tmp_path):
    model = saved(tmp_path)
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config.mtp_depth == 2
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_loading_mtp_blocks_into_mtp_depth_0_drops_them_in_one_logged_line(tmp_path, caplog):
    model = saved(tmp_path)
    with caplog.at_level(logging.WARNING):
        loaded = load_hf_checkpoint(tmp_path, config_overrides={"mtp_depth": 0})
    lines = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.[5, 6]" in lines[0] and "\n" not in lines[0]
    ref = model.state_dict()
    assert all(torch.equal(t, ref[k]) for k, t in loaded.state_dict().items()) and len(loaded.model.layers) == 5
