"""Test-only fault injection: a trainer callback driven by environment variables (never imported by production).

The fault suite (tests/fault/, launch/fault_matrix.sh) needs faults at exact, reproducible points of a real
launcher run. The run harness (tests/distributed/conftest.py `run_training`) adds
`callbacks=[tests.fault.injector.FaultInjector]` whenever a K3_FAULT_* variable is set; the callback reads:

    K3_FAULT_NAN_AT_STEP=3,4        the loss of these (1-based) steps is NaN (forward value and gradient)
    K3_FAULT_INF_GRAD_AT_STEP=3     the loss value stays finite, its gradient is +inf (a gradient-only fault)
    K3_FAULT_RANK=1                 restrict the faults to this rank (default: every rank)
    K3_FAULT_KILL_AT_STEP=4         SIGKILL this process right after optimizer step 4 (after its metrics line,
                                    before any checkpoint of 4)
    K3_FAULT_KILL_IN_CKPT_PHASE=p   with K3_FAULT_KILL_AT_STEP=k: SIGKILL inside the checkpoint write of step k
                                    at phase p (training.checkpoint.SAVE_PHASES), instead of after the step
    K3_FAULT_PAUSE_AT_STEP=4        sleep K3_FAULT_PAUSE_S (default 5) seconds right after optimizer step 4 (its
                                    peers wait in the next step's first collective: a window to cut a node off)

NaN/Inf faults use PyTorch's own seam, a forward hook on the model that replaces the output's loss.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from training.callbacks import Callback
from training.checkpoint import SAVE_PHASES


def parse_steps(name: str) -> frozenset[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return frozenset()
    try:
        return frozenset(int(s) for s in raw.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a comma-separated list of step numbers, e.g. 3,4") from None


class _InfGrad(torch.autograd.Function):
    """Identity forward; the backward turns the incoming gradient into +inf (finite loss, non-finite grads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g * float("inf")


def poison(loss: torch.Tensor, step: int, nan_steps: frozenset[int], inf_steps: frozenset[int]) -> torch.Tensor:
    """The loss of (1-based) `step`, poisoned when a NaN/Inf fault targets it."""
    if step in nan_steps:
        return loss * float("nan")
    if step in inf_steps:
        return _InfGrad.apply(loss)
    return loss


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9: no cleanup, no flush, no atexit


class FaultInjector(Callback):
    def __init__(self) -> None:
        self.nan = parse_steps("K3_FAULT_NAN_AT_STEP")
        self.inf = parse_steps("K3_FAULT_INF_GRAD_AT_STEP")
        self.kill = parse_steps("K3_FAULT_KILL_AT_STEP")
        self.phase = os.environ.get("K3_FAULT_KILL_IN_CKPT_PHASE") or None
        self.pause = parse_steps("K3_FAULT_PAUSE_AT_STEP")
        self.pause_s = float(os.environ.get("K3_FAULT_PAUSE_S", "5"))
        rank = os.environ.get("K3_FAULT_RANK")
        self.rank = int(rank) if rank else None
        if self.phase is not None and self.phase not in SAVE_PHASES:
            raise ValueError(f"K3_FAULT_KILL_IN_CKPT_PHASE={self.phase!r} must be one of {'|'.join(SAVE_PHASES)}")

    def _mine(self, trainer) -> bool:
        return self.rank is None or self.rank == trainer.info.rank

    def on_train_start(self, trainer) -> None:
        if not (self.nan or self.inf) or not self._mine(trainer):
            return

        def hook(_module: torch.nn.Module, _args: Any, out: Any) -> Any:
            if out.loss is not None and torch.is_grad_enabled():
                out.loss = poison(out.loss, trainer.step + 1, self.nan, self.inf)
            return out

        trainer.module.register_forward_hook(hook)

    def on_step_end(self, trainer) -> None:
        if self.phase is None and trainer.step in self.kill and self._mine(trainer):
            _kill()
        if trainer.step in self.pause and self._mine(trainer):
            time.sleep(self.pause_s)

    def on_checkpoint_phase(self, trainer, phase: str, step: int) -> None:
        if self.phase == phase and step in self.kill and self._mine(trainer):
            _kill()
