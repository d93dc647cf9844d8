"""The streamed export's reference: today's consolidated path (the whole model built, then saved), tensor by tensor."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from model import save_hf_checkpoint
from model.lora import merge_lora
from training.tools.export import load_checkpoint_model


def zero0_tag(root: Path, model: torch.nn.Module) -> Path:
    """A ZeRO-0 checkpoint step dir as the trainer writes it: module state, config.json, COMPLETE."""
    tag = root / "checkpoints" / "step_1"
    tag.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, tag / "mp_rank_00_model_states.pt")
    model.config.save(tag)
    (tag / "COMPLETE").write_text("")
    return tag


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_as_consolidated(checkpoint: Path, streamed: Path, tmp: Path) -> None:
    """Every tensor of `streamed` equals (dtype and bits) the consolidated export's (model built, then saved)."""
    model, _ = load_checkpoint_model(str(checkpoint))
    if hasattr(model, "lora_spec"):  # a LoRA checkpoint: base + adapters, merged in memory
        merge_lora(model)
    save_hf_checkpoint(model, tmp / "consolidated")
    a, b = tensors(tmp / "consolidated"), tensors(streamed)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
