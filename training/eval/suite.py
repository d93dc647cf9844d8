"""An evaluation suite: the configured loss sets and tasks, run together without changing training.

Same code in the loop (training/eval/callback.py) and on a checkpoint (training/eval/tool.py). `run` puts the
model in eval mode under `no_grad` and gives back exactly what it found: the train/eval mode and the RNG states of
torch, numpy and Python (restored even if a task fails). It never touches the data loader, the optimizer or the
router: MoE forwards in eval mode only count loads (model/moe/layer.py), and their statistics never reach the
balancers, which only see the training step's (training/balance.py). Results are flat:
`eval/<set or task>/<metric>`.
"""

from __future__ import annotations

import time
from typing import Any

from training.checkpoint import rng_state, set_rng_state
from training.eval.forward import EvalContext
from training.eval.goals import goal  # noqa: F401  (re-exported: the callback reads it here)
from training.eval.loss import evaluate_loss
from training.eval.sets import LossSet, build_loss_set
from training.eval.tasks import Task, build_task


class EvalSuite:
    """The sets and tasks of one `eval` config section, built once (every rank builds the same)."""

    def __init__(self, eval_cfg: Any, data: Any, tokenizer: Any, seq_len: int, loss_on: str = "assistant") -> None:
        self.sets: list[LossSet] = [
            build_loss_set(dict(spec), data, tokenizer, seq_len, loss_on) for spec in eval_cfg.sets
        ]
        self.tasks: list[Task] = [build_task(dict(spec), tokenizer, seq_len) for spec in eval_cfg.tasks]
        for task, spec in zip(self.tasks, eval_cfg.tasks):
            task.every = int(spec.get("every") or 0)  # type: ignore[attr-defined]  # 0: at every evaluation
        self._ran: set[str] = set()

    def __len__(self) -> int:
        return len(self.sets) + len(self.tasks)

    def run(self, ctx: EvalContext, step: int | None = None, final: bool = True) -> dict[str, float]:
        """Every set, and the tasks due at `step` (a task's own `every` steps, its first call and the `final`
        one; all of them when step is None: a checkpoint's evaluation)."""
        module = ctx.module
        was_training, rng = module.training, rng_state()
        module.eval()
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            for s in self.sets:
                out.update({f"eval/{s.name}/{k}": v for k, v in evaluate_loss(ctx, s).items()})
            for task in self.tasks:
                every = int(getattr(task, "every", 0) or 0)
                if step is not None and every and step % every and not final and task.name in self._ran:
                    continue
                self._ran.add(task.name)
                t1 = time.perf_counter()
                out.update({f"eval/{task.name}/{k}": v for k, v in task.evaluate(ctx).items()})
                out[f"eval/{task.name}/time_s"] = time.perf_counter() - t1
        finally:
            module.train(was_training)
            set_rng_state(rng)
        out["eval/time_s"] = time.perf_counter() - t0
        return out
