"""The trainer's hook seam: callbacks observe the loop and add to its log records; the loop stays small.

Order of calls per optimizer step: `on_step` (every step, after the optimizer step), `on_log` (logging steps only:
add keys to the record before it is written), `on_step_end` (after the record is written, before a checkpoint),
`on_checkpoint_phase` (inside each checkpoint write, see training/checkpoint/store.py SAVE_PHASES). Callbacks named
by import path in `callbacks=[pkg.module.Class, ...]` are built with no arguments; production code never imports
test machinery such as the fault injector, which plugs in this way.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn

from training.step import StepResult


class Trainer(Protocol):
    """What callbacks may read of the trainer (training/trainer.py implements it); callbacks never drive it."""

    step: int  # optimizer steps done
    start_step: int  # the step this session started (resumed) at
    world: int
    tokens_seen: int
    flops_per_token: float
    peak: float
    module: nn.Module
    moe_layers: list[nn.Module]
    moe_layer_ids: list[int]
    info: Any  # training.distributed.DistInfo
    loader: Any  # data.GlobalBatchLoader
    logger: Any  # training.metrics.RunLogger


class Callback:
    """Every hook is optional; the default does nothing."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step(self, trainer: Trainer, result: StepResult) -> None: ...

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None: ...

    def on_step_end(self, trainer: Trainer) -> None: ...

    def on_checkpoint_phase(self, trainer: Trainer, phase: str, step: int) -> None: ...

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...


class CallbackList(Callback):
    """Calls each callback in order."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_train_start(self, trainer: Trainer) -> None:
        for c in self.callbacks:
            c.on_train_start(trainer)

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        for c in self.callbacks:
            c.on_step(trainer, result)

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_log(trainer, record)

    def on_step_end(self, trainer: Trainer) -> None:
        for c in self.callbacks:
            c.on_step_end(trainer)

    def on_checkpoint_phase(self, trainer: Trainer, phase: str, step: int) -> None:
        for c in self.callbacks:
            c.on_checkpoint_phase(trainer, phase, step)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        for c in self.callbacks:
            c.on_train_end(trainer, summary)


def load_callback(path: str) -> Callback:
    """`pkg.module.Class` (or `pkg.module:Class`) -> an instance; one-line ValueError naming the fix."""
    mod_name, _, cls_name = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"callbacks: cannot import {path!r} ({e}); give pkg.module.Class on the Python path") from None
    cb = cls()
    if not isinstance(cb, Callback):
        raise ValueError(f"callbacks: {path} is not a training.callbacks.Callback subclass")
    return cb
