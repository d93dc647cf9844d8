"""training.export of a multimodal run (issue 23 §2): the vision tensors leave in the release's names, bitwise; a
run that trained only the text model exports text-only and says so in one line."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from model import K3ForCausalLM, K3ForConditionalGeneration, load_hf_checkpoint
from tests.model.vision_micro import micro_mm_config, randomise
from tests.training.export_compare import zero0_tag
from training.tools.export import export_checkpoint


def test_export_of_a_multimodal_state_keeps_every_vision_tensor_bitwise(tmp_path):
    m = randomise(K3ForConditionalGeneration(micro_mm_config()), std=0.1)
    out = export_checkpoint(str(zero0_tag(tmp_path, m)), str(tmp_path / "hf"))
    saved = load_file(f"{out}/model.safetensors")
    for k, t in m.state_dict().items():
        if k.startswith(("vision_tower.", "mm_projector.")):
            assert torch.equal(saved[k], t), k
    loaded = load_hf_checkpoint(out)
    assert isinstance(loaded, K3ForConditionalGeneration)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), loaded.state_dict().values()))


def test_export_of_a_text_state_with_a_tower_config_is_text_only_and_says_so(tmp_path, capsys):
    m = K3ForCausalLM(micro_mm_config())
    out = export_checkpoint(str(zero0_tag(tmp_path, m)), str(tmp_path / "hf"))
    err = capsys.readouterr().err
    assert "holds no vision tensors" in err and "writing a text-only checkpoint" in err
    assert type(load_hf_checkpoint(out)) is K3ForCausalLM
