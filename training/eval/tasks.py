"""Task types of `eval.tasks` (each `{type, name, ...}`): a registry from type name to its builder.

A task is built once from its spec, the tokenizer and the context length, and `evaluate(ctx)` returns its metrics
(`eval/<name>/<metric>`), the same numbers at any parallel layout (training/eval/forward.py). Types: `choice`
(multiple choice by log-likelihood, training/eval/choice.py), `passkey` (long-context retrieval,
training/eval/passkey.py) and `caption` (image captions with their own vs shuffled images, training/eval/caption.py).
Every task also takes `every: N`: in the loop it runs at its first evaluation, every N steps and at the last step
(0, the default: at every evaluation); a checkpoint's evaluation runs it always.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from training.eval.forward import EvalContext
from training.eval.sets import EvalConfigError

TASK_TYPES = {
    "caption": "training.eval.caption:CaptionTask",
    "choice": "training.eval.choice:ChoiceTask",
    "passkey": "training.eval.passkey:PasskeyTask",
}


class Task(Protocol):
    name: str

    def evaluate(self, ctx: EvalContext) -> dict[str, float]: ...


def task_class(kind: str) -> Any:
    if kind not in TASK_TYPES:
        raise EvalConfigError(f"eval.tasks: unknown task type {kind!r}; use one of {sorted(TASK_TYPES)}")
    mod, _, cls = TASK_TYPES[kind].partition(":")
    return getattr(importlib.import_module(mod), cls)


def build_task(spec: dict[str, Any], tokenizer: Any, seq_len: int) -> Task:
    kind, name = spec.get("type"), spec.get("name") or spec.get("type")
    if not kind:
        raise EvalConfigError(f"eval.tasks entry {spec} has no type; give type: <{'|'.join(sorted(TASK_TYPES))}>")
    return task_class(str(kind))(str(name), spec, tokenizer, seq_len)
