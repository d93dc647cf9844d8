"""Held-out evaluation in the training loop: every `eval.every` steps, at the last step, and (`eval.on_start`)
before the first step of a session.

The record goes to metrics.jsonl / W&B through the run's logger at the training step, as its own line:
`{"step", "time", "tokens_seen" (training tokens so far), "eval/<set or task>/<metric>": ...}`; the W&B summary
keeps each metric's best value and summary.json gets `best/eval/<name>/<metric>` (min for loss, ppl, bpb, max for
accuracies). Every rank evaluates (expert and sequence parallelism need all of them); the evaluation changes
nothing in training (training/eval/suite.py), so a run's training losses are bitwise those of the run without it.
"""

from __future__ import annotations

from typing import Any

from training.callbacks.base import Callback
from training.eval.forward import EvalContext
from training.eval.goals import goal
from training.eval.suite import EvalSuite


class EvalCallback(Callback):
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.every, self.on_start = int(cfg.eval.every), bool(cfg.eval.on_start)
        self.suite: EvalSuite | None = None
        self.best: dict[str, float] = {}
        self.last: dict[str, float] = {}  # the newest evaluation (checkpoint.keep_best reads it)
        self.last_step = -1

    def _ctx(self, trainer: Any) -> EvalContext:
        rows = int(self.cfg.eval.batch_rows) or int(self.cfg.train.micro_batch_size)
        return EvalContext.of_trainer(trainer, rows)

    def evaluate(self, trainer: Any) -> dict[str, float]:
        assert self.suite is not None
        final = trainer.step == int(self.cfg.train.steps)
        metrics = self.suite.run(self._ctx(trainer), trainer.step, final)
        goals = {k: g for k in metrics if (g := goal(k)) is not None}
        for k, g in goals.items():
            v, b = metrics[k], self.best.get(k)
            if b is None or (v < b if g == "min" else v > b):
                self.best[k] = v
        self.last, self.last_step = metrics, trainer.step
        trainer.logger.log_eval(trainer.step, {"tokens_seen": trainer.tokens_seen, **metrics}, goals)
        if trainer.is_main:
            shown = " ".join(f"{k.removeprefix('eval/')}={v:.4g}" for k, v in metrics.items() if _shown(k))
            print(f"eval step {trainer.step}: {shown}", flush=True)
        return metrics

    def on_train_start(self, trainer: Any) -> None:
        c = self.cfg
        self.suite = EvalSuite(
            c.eval, trainer.loader.cfg, trainer.tokenizer, int(c.train.seq_len), str(c.train.loss_on)
        )
        if self.on_start:
            self.evaluate(trainer)

    def on_step_end(self, trainer: Any) -> None:
        if self.every and (trainer.step % self.every == 0 or trainer.step == int(self.cfg.train.steps)):
            self.evaluate(trainer)

    def on_train_end(self, trainer: Any, summary: dict[str, Any]) -> None:
        # a metric's best (not every position bucket / passkey cell: those stay in metrics.jsonl)
        summary.update({f"best/{k}": v for k, v in self.best.items() if k.count("/") == 2})


def _shown(key: str) -> bool:
    leaf = key.rsplit("/", 1)[-1]
    return leaf in ("loss", "loss_shuffled", "ratio", "bpb", "acc", "acc_norm") or leaf.startswith("acc@")


def eval_callbacks(cfg: Any) -> list[Callback]:
    """The in-loop evaluation when the run configures one (eval.every > 0 or eval.on_start)."""
    e = cfg.get("eval")
    if e is None or not (int(e.every) or bool(e.on_start)) or not (len(e.sets) or len(e.tasks)):
        return []
    evaluation = EvalCallback(cfg)
    metric = cfg.checkpoint.get("keep_best")
    if not metric:
        return [evaluation]
    from training.checkpoint.best import KeepBest

    return [evaluation, KeepBest(str(metric), goal(str(metric)) or "min", evaluation)]
