"""`train.freeze`: named parts of the model get `requires_grad = False` before the optimizer is built.

Why this is enough: `training.engine.param_groups` (and the EP groups built on it) keep only parameters that
require grad, so a frozen parameter never reaches DeepSpeed's optimizer: ZeRO-1/2/3 partition no optimizer state
or gradient buffer for it (DeepSpeed's contract: only the client optimizer's param groups are managed), and
autograd leaves its `.grad` unset. Works on K3ForCausalLM and K3ForConditionalGeneration (docs/model.md §14).

ZeRO-3: the sharded start (training/parallel/construct.py) has already partitioned the parameters when this runs;
`requires_grad` is a flag of the Parameter object, which ZeRO-3's conversion keeps (`_convert_to_deepspeed_param`
swaps `.data` for an empty placeholder, not the object), and stage3 `_get_trainable_parameter_groups` drops the
frozen ones again. The checkpoint keeps their partitions as `frozen_param_fragments`, which the export reads
(training/parallel/universal.py `frozen_params`). A partitioned parameter's `numel()` is 0: its size is `ds_numel`.
"""

from __future__ import annotations

from torch import nn

GROUPS = ("vision_tower", "mm_projector", "language_model", "embeddings")


def freeze_modules(model: nn.Module, group: str) -> nn.Module:
    """The module `group` names in `model`; ValueError (one line) for an unknown group or one the model lacks."""
    if group not in GROUPS:
        raise ValueError(f"train.freeze has unknown group {group!r}; choose from {list(GROUPS)}")
    text = getattr(model, "language_model", model)  # the text model inside a K3ForConditionalGeneration
    if group == "language_model":
        return text
    if group == "embeddings":
        return text.model.embed_tokens
    part = getattr(model, group, None)
    if not isinstance(part, nn.Module):
        raise ValueError(f"train.freeze={group}: the model has no {group} (a text-only model: set model.vision_config)")
    return part


def freeze(model: nn.Module, groups: list[str]) -> int:
    """Freeze every parameter of `groups`; returns how many elements were frozen (each counted once)."""
    seen: dict[int, int] = {}
    for g in groups:
        for p in freeze_modules(model, str(g)).parameters():
            p.requires_grad_(False)
            seen[id(p)] = int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3: the full size, not the placeholder's
    return sum(seen.values())
