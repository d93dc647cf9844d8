"""checkpoint.keep_best (training/checkpoint/best.py): the marker follows the best evaluated checkpoint, keep-last
pruning never deletes it, and the marker resolves as a checkpoint path (training.export / training.evaluate)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from training.checkpoint import resolve_checkpoint, tag_for
from training.checkpoint.best import KeepBest, read_best
from training.checkpoint.store import COMPLETE, _prune
from training.checks import TrainConfigError
from training.config import compose, validate


def _commit(root, step: int) -> str:
    tag = os.path.join(root, tag_for(step))
    os.makedirs(tag)
    open(os.path.join(tag, COMPLETE), "w").close()
    return tag


def test_the_best_checkpoint_is_marked_kept_past_keep_last_and_resolvable(tmp_path):
    root = str(tmp_path / "checkpoints")
    evaluation = SimpleNamespace(last={}, last_step=-1)
    keep = KeepBest("eval/heldout/loss", "min", evaluation)
    trainer = SimpleNamespace(is_main=True, ckpt_root=root)
    for step, loss in [(2, 5.0), (4, 4.0), (6, 4.5), (8, 4.2)]:
        _commit(root, step)
        evaluation.last, evaluation.last_step = {"eval/heldout/loss": loss}, step
        keep.on_checkpoint_phase(trainer, "before_prune", step)
        _prune(root, keep_last=1, keep=tag_for(step))
    assert read_best(root) == {"metric": "eval/heldout/loss", "value": 4.0, "step": 4, "tag": tag_for(4)}
    assert sorted(d for d in os.listdir(root) if d.startswith("step_")) == [tag_for(4), tag_for(8)]
    assert resolve_checkpoint(os.path.join(root, "best")) == os.path.join(root, tag_for(4))
    evaluation.last_step = 10  # a checkpoint at a step without an evaluation does not compete
    _commit(root, 10)
    keep.on_checkpoint_phase(trainer, "before_prune", 10)
    assert read_best(root)["step"] == 4


def test_keep_best_must_name_a_metric_the_run_evaluates():
    good = ["eval=heldout", "checkpoint.keep_best=eval/heldout/loss"]
    validate(compose(good), 1)
    with pytest.raises(TrainConfigError, match="checkpoint.keep_best=eval/nope/loss is not a metric"):
        validate(compose(["eval=heldout", "checkpoint.keep_best=eval/nope/loss"]), 1)
    with pytest.raises(TrainConfigError, match="needs evaluations: set eval.every > 0"):
        validate(compose([*good, "eval.every=0"]), 1)
