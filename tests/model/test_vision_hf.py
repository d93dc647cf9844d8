"""Multimodal checkpoints (issue 23 §2): vision tensors under the release's names, both text prefixes, dropping
vision only when asked (one logged line), one-line errors naming a vision key that does not fit."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import K3ForCausalLM, K3ForConditionalGeneration, load_hf_checkpoint, save_hf_checkpoint
from model.hf import CheckpointError
from tests.model.vision_micro import images, micro_mm_config, randomise


def _model() -> K3ForConditionalGeneration:
    return randomise(K3ForConditionalGeneration(micro_mm_config()), std=0.1)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_multimodal_round_trip_is_exact_and_uses_the_release_names(tmp_path):
    m = _model()
    save_hf_checkpoint(m, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    vision = {k for k in keys if k.startswith("vision_tower.")}
    assert len(vision) == 3 + 6 * 2  # patch_embed.proj, pos_emb, final norm + six per block (release: 3 + 6 x 27)
    assert {k for k in keys if k.startswith("mm_projector.")} == {
        "mm_projector.proj.0.weight",
        "mm_projector.proj.2.weight",
        "mm_projector.post_norm.weight",
    }
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in vision
    assert all(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in keys)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["KimiK3ForConditionalGeneration"]
    loaded = load_hf_checkpoint(tmp_path)
    assert isinstance(loaded, K3ForConditionalGeneration) and loaded.config == m.config
    _same(m, loaded)
    px, grid = images([(2, 4)], dtype=torch.float32)
    ids = torch.tensor([[1, 2, 60, 60, 3]])
    assert torch.equal(m(ids, px, grid).logits, loaded(ids, px, grid).logits)


def test_text_keys_in_the_text_only_spelling_load_beside_vision_keys(tmp_path):
    m = _model()
    save_hf_checkpoint(m, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state = {k.removeprefix("language_model."): t for k, t in state.items()}  # `model.*`, `lm_head.weight`
    save_file(state, str(tmp_path / "model.safetensors"))
    _same(m, load_hf_checkpoint(tmp_path))


def test_dropping_vision_is_explicit_and_said_in_one_line(tmp_path, caplog):
    m = _model()
    save_hf_checkpoint(m, tmp_path)
    with caplog.at_level(logging.WARNING, logger="model.hf"):
        text = load_hf_checkpoint(tmp_path, text_only=True)
    assert type(text) is K3ForCausalLM and text.config.vision_config is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "dropping its 18 vision tensors" in lines[0] and "\n" not in lines[0]
    _same(m.language_model, text)


def test_vision_tensors_without_a_vision_config_are_an_error(tmp_path):
    m = _model()
    save_hf_checkpoint(m, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(m.config.text_only().to_hf_config()))
    with pytest.raises(CheckpointError, match=r"unknown keys \[mm_projector\..*add it, or drop them with text_only"):
        load_hf_checkpoint(tmp_path)


def test_a_vision_key_that_does_not_fit_is_named(tmp_path):
    m = _model()
    save_hf_checkpoint(m, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["vision_tower.encoder.blocks.1.wo.weight"] = torch.zeros(16, 8)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"^vision_tower\.encoder\.blocks\.1\.wo\.weight has shape \(16, 8\)"):
        load_hf_checkpoint(tmp_path)
    state["vision_tower.encoder.blocks.1.wo.weight"] = m.vision_tower.encoder.blocks[1].wo.weight.detach().clone()
    state["vision_tower.encoder.blocks.2.wo.weight"] = torch.zeros(16, 16)  # a third block the config lacks
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unknown keys \[vision_tower\.encoder\.blocks\.2\.wo\.weight\]"):
        load_hf_checkpoint(tmp_path)


def test_a_text_model_with_a_tower_config_saves_a_text_only_checkpoint(tmp_path, caplog):
    m = K3ForCausalLM(micro_mm_config())
    with caplog.at_level(logging.WARNING, logger="model.hf"):
        save_hf_checkpoint(m, tmp_path)
    assert "writing a text-only config.json" in caplog.text
    loaded = load_hf_checkpoint(tmp_path)
    assert type(loaded) is K3ForCausalLM and loaded.config == m.config.text_only()
