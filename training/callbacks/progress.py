"""Loss windows and throughput: the per-log-step averages a person reads on the console and the dashboard."""

from __future__ import annotations

import time
from typing import Any

import psutil
import torch

from training.callbacks.base import Callback, Trainer
from training.metrics import memory_stats, mfu
from training.step import StepResult


class LossWindow(Callback):
    """`loss_avg`: the mean loss of the steps since the previous log line (single-step losses are noisy)."""

    def __init__(self) -> None:
        self.window: list[float] = []
        self.first_loss: float | None = None
        self.first_avg: float | None = None
        self.last_avg: float | None = None

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        self.window.append(result.loss)
        if self.first_loss is None:
            self.first_loss = result.loss

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.window:
            record["loss_avg"] = self.last_avg = sum(self.window) / len(self.window)
            self.first_avg = self.last_avg if self.first_avg is None else self.first_avg
            self.window.clear()

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary.update(first_loss=self.first_loss, first_loss_avg=self.first_avg, final_loss_avg=self.last_avg)


class Throughput(Callback):
    """tokens/s and MFU over the steps since the previous log line; memory; time to the first step.

    tokens/s in the summary counts only this session's tokens over this session's time, so a resumed run reports
    its own speed (tokens seen before the resume are not divided by the new session's seconds)."""

    def __init__(self) -> None:
        self.t_start = self.t_last = time.time()
        self.tok_last = self.session_tokens = 0
        self.first_step_s: float | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        self.t_start = self.t_last = time.time()

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        self.tok_last += result.tokens
        self.session_tokens += result.tokens
        if self.first_step_s is None:  # from process start: includes imports, data and engine set-up
            self.first_step_s = time.time() - psutil.Process().create_time()

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        now = time.time()
        tps = self.tok_last / max(1e-9, now - self.t_last)
        self.t_last, self.tok_last = now, 0
        record.update(
            tokens_per_s=tps,
            mfu=mfu(tps / trainer.world, trainer.flops_per_token, trainer.peak),
            tokens_seen=trainer.tokens_seen,
            **memory_stats(),
        )
        if (
            self.first_step_s is not None
            and "time_to_first_step_s" not in record
            and trainer.step == trainer.start_step + 1
        ):
            record["time_to_first_step_s"] = self.first_step_s

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        elapsed = time.time() - self.t_start
        summary.update(
            elapsed_s=elapsed,
            time_to_first_step_s=self.first_step_s,
            session_tokens=self.session_tokens,
            tokens_per_s=self.session_tokens / max(1e-9, elapsed),
            torch_threads=torch.get_num_threads(),
        )


class DataStats(Callback):
    """The loader's counters (`data/*`: documents, skipped records per kind, loss-token fraction, ...)."""

    def on_log(self, trainer: Trainer, record: dict[str, Any]) -> None:
        stats = trainer.loader.stats()
        record.update({f"data/{k}": v for k, v in stats.items() if isinstance(v, (int, float))})
