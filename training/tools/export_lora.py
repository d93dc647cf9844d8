"""Export of LoRA checkpoints (finetune=lora): the adapters in PEFT's layout, or the base with them merged.

A LoRA checkpoint holds only the adapters (and their optimizer state); `lora.json` names the base (path + content
hash, training/lora.py). The trained model is that base + the adapters, rebuilt here on CPU in fp32:

* `--adapters`: `adapter_model.safetensors` + `adapter_config.json` as PEFT writes them, keys by the release's
  module names (`base_model.model.language_model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, routed
  experts per expert: `...block_sparse_moe.experts.{j}.w1.lora_A.weight` [r, l]); the experts' rank and scale
  through PEFT's `rank_pattern` / `alpha_pattern` (scale = alpha / rank in both).
* `--merge`: the base with W + (alpha/r) B A folded in (model/lora.py `merge_lora`), a full HF checkpoint.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

from model import K3ForCausalLM, load_hf_checkpoint
from model.lora import EXPERT_WEIGHTS, LINEAR_TARGETS, adapter_state, apply_lora
from training.lora import base_identity, spec_of

PEFT_PREFIX = "base_model.model.language_model."  # PEFT's wrapper + the release's text prefix
_EXPERT_FACTOR = re.compile(r"^(.*\.experts)\.lora\.(w[123])_([AB])$")


def check_base(record: dict) -> None:
    """The base named in `record` exists and has the content it had in training, else one line."""
    base = record["base.path"]
    if not os.path.isdir(base):
        raise FileNotFoundError(f"the LoRA base {base} is gone; restore it (the checkpoint holds adapters only)")
    if base_identity(base)["base.hash"] != record["base.hash"]:
        raise ValueError(f"the LoRA base {base} changed since training (content hash differs); restore that base")


def lora_model(record: dict, state: dict[str, torch.Tensor]) -> K3ForCausalLM:
    """The trained model: the base named in `record` (refused in one line if its content changed) + adapters."""
    check_base(record)
    model = load_hf_checkpoint(record["base.path"], dtype=torch.float32)
    apply_lora(model, spec_of(record))
    want = set(adapter_state(model))
    have = {k: v for k, v in state.items() if k in want}
    if set(have) != want:
        raise ValueError(f"the checkpoint lacks {len(want - set(have))} adapter tensors; is it a LoRA checkpoint?")
    model.load_state_dict({k: v.float() for k, v in have.items()}, strict=False)
    return model.eval()


def peft_tensors(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT's key names (experts split per global expert id)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in adapter_state(model).items():
        t = t.detach().float().contiguous()
        m = _EXPERT_FACTOR.match(name)
        if m is None:  # `<module>.lora_A.weight`: PEFT's spelling already
            out[PEFT_PREFIX + name] = t
            continue
        prefix, w, ab = m.groups()
        for j in range(t.shape[0]):
            out[f"{PEFT_PREFIX}{prefix}.{j}.{w}.lora_{ab}.weight"] = t[j].clone()
    return out


def peft_config(record: dict) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields for these adapters."""
    linear = [t for t in record["targets"] if t in LINEAR_TARGETS]
    experts = "experts" in record["targets"] and int(record["expert_rank"]) > 0
    pattern = r"experts\.\d+\.w[123]"
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": record["base.path"],
        "r": int(record["rank"]),
        "lora_alpha": float(record["alpha"]),
        "lora_dropout": float(record["dropout"]),
        "target_modules": linear + (list(EXPERT_WEIGHTS) if experts else []),
        "rank_pattern": {pattern: int(record["expert_rank"])} if experts else {},
        "alpha_pattern": {pattern: float(record["alpha"])} if experts else {},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def write_adapters(model: K3ForCausalLM, record: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    save_file(peft_tensors(model), os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(peft_config(record), f, indent=2, sort_keys=True)
    return out_dir
