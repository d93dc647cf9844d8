"""Router health on the dashboard: MaxVio, load CV, dead experts and bias statistics per MoE layer, plus the
layers x experts load heatmap, from the step's global counts (reduced once by the trainer, training/balance.py)."""

from __future__ import annotations

from typing import Any

from training.balance import biases_LE
from training.callbacks.base import Callback, Trainer
from training.metrics import router_metrics
from training.step import StepResult


class RouterHealth(Callback):
    def __init__(self) -> None:
        self.last: StepResult | None = None

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        self.last = result

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        r = self.last
        if r is None or r.counts_LE is None:
            return
        extra = r.balance_extra if any(r.balance_extra) else None
        record.update(router_metrics(r.counts_LE.float(), biases_LE(trainer.moe_layers), trainer.moe_layer_ids, extra))
        trainer.logger.log_heatmap(trainer.step, r.counts_LE, trainer.moe_layer_ids)
