"""`checkpoint.keep_best=<metric>`: the best-scoring checkpoint, kept beside the newest `keep_last` and marked.

`<run_dir>/checkpoints/best` names its tag (like `latest`, replaced atomically) and `best.json` says why
(`{"metric", "value", "step", "tag"}`). Keep-last pruning never deletes the tag `best` names (store._prune), and
`training.checkpoint.resolve_checkpoint` accepts the marker as a path (`python -m training.export
runs/x/checkpoints/best out/`, `python -m training.evaluate checkpoint=runs/x/checkpoints/best`).

A checkpoint competes when it is written at a step whose evaluation produced the metric (align checkpoint.every
with eval.every); lower is better for losses (loss, ppl, bpb), higher for accuracies (training/eval/suite.py
`goal`). The marker is moved by rank 0 inside the checkpoint write, after COMPLETE and `latest`, before pruning
(the `before_prune` phase of store.save), so a crash leaves it naming a complete checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Any

from data.files import atomic_write
from training.callbacks.base import Callback
from training.checkpoint.store import BEST, tag_for

BEST_INFO = "best.json"


def read_best(root: str) -> dict[str, Any] | None:
    """best.json of a checkpoints dir when its `best` marker names a tag that is still there, else None."""
    try:
        with open(os.path.join(root, BEST), encoding="utf-8") as f:
            tag = f.read().strip()
        with open(os.path.join(root, BEST_INFO), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if info.get("tag") == tag and os.path.isdir(os.path.join(root, tag)) else None


def best_tag(root: str) -> str | None:
    info = read_best(root)
    return info["tag"] if info else None


def better(value: float, than: float, goal: str) -> bool:
    return value < than if goal == "min" else value > than


def mark_best(root: str, tag: str, metric: str, value: float, step: int) -> None:
    atomic_write(
        os.path.join(root, BEST_INFO), json.dumps({"metric": metric, "value": value, "step": step, "tag": tag})
    )
    atomic_write(os.path.join(root, BEST), tag)


class KeepBest(Callback):
    """Moves the `best` marker when a checkpoint's step was evaluated and its metric beats the marked one."""

    def __init__(self, metric: str, goal: str, evaluation: Any) -> None:
        self.metric, self.goal, self.evaluation = metric, goal, evaluation  # evaluation: training.eval EvalCallback

    def on_checkpoint_phase(self, trainer: Any, phase: str, step: int) -> None:
        if phase != "before_prune" or not trainer.is_main:
            return
        last = self.evaluation.last
        if self.evaluation.last_step != step or self.metric not in last:
            return
        root, value = trainer.ckpt_root, float(last[self.metric])
        info = read_best(root)
        if info is None or info.get("metric") != self.metric or better(value, float(info["value"]), self.goal):
            mark_best(root, tag_for(step), self.metric, value, step)
