"""k3-train model package: the K3 network in pure PyTorch.

Public API: `K3Config`, `K3ForCausalLM`, `K3ForConditionalGeneration` (with images), `build_model`,
`load_hf_checkpoint`, `save_hf_checkpoint`, `count_params`, `count_vision_params`.
The heavy submodules are imported lazily so `import model.config` stays cheap and independent of the mixers.
"""

from __future__ import annotations

import importlib
from typing import Any

from model.config import ConfigError, K3Config

_LAZY = {
    "K3ForCausalLM": "model.k3",
    "K3Model": "model.k3",
    "K3Output": "model.k3",
    "K3Cache": "model.k3",
    "K3ForConditionalGeneration": "model.vision.multimodal",
    "build_model": "model.hf",
    "VisionConfig": "model.vision.config",
    "load_hf_checkpoint": "model.hf",
    "save_hf_checkpoint": "model.hf",
    "cast_model": "model.hf",
    "CheckpointError": "model.hf",
    "count_params": "model.params",
    "count_vision_params": "model.params",
    "param_breakdown": "model.params",
    "generate": "model.generate",
}

__all__ = ["ConfigError", "K3Config", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
