"""Test-only fault injection, driven by environment variables; zero cost when none is set.

The fault suite (tests/fault/, launch/fault_matrix.sh) needs faults at exact, reproducible points of a real
launcher run. Every hook reads its variable once (at import) and is a plain `if` afterwards:

    K3_FAULT_NAN_AT_STEP=3,4        the loss of these (1-based) steps is NaN (forward value and gradient)
    K3_FAULT_INF_GRAD_AT_STEP=3     the loss value stays finite, its gradient is +inf (a gradient-only fault)
    K3_FAULT_RANK=1                 restrict the NaN/Inf faults and the kill to this rank (default: every rank)
    K3_FAULT_KILL_AT_STEP=4         SIGKILL this process right after optimizer step 4 (before any checkpoint of 4)
    K3_FAULT_KILL_IN_CKPT_PHASE=p   with K3_FAULT_KILL_AT_STEP=k: SIGKILL inside the checkpoint write of step k
                                    at phase p (see CKPT_PHASES), instead of after the step
"""
from __future__ import annotations

import os
import signal

import torch

CKPT_PHASES = ("begin", "after_engine_save", "after_rank_file", "before_complete", "before_latest", "before_prune")


def _steps(name: str) -> frozenset[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return frozenset()
    try:
        return frozenset(int(s) for s in raw.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a comma-separated list of step numbers, e.g. 3,4") from None


NAN_STEPS = _steps("K3_FAULT_NAN_AT_STEP")
INF_GRAD_STEPS = _steps("K3_FAULT_INF_GRAD_AT_STEP")
KILL_STEPS = _steps("K3_FAULT_KILL_AT_STEP")
KILL_PHASE = os.environ.get("K3_FAULT_KILL_IN_CKPT_PHASE") or None
FAULT_RANK = int(os.environ["K3_FAULT_RANK"]) if os.environ.get("K3_FAULT_RANK") else None
ACTIVE = bool(NAN_STEPS or INF_GRAD_STEPS or KILL_STEPS)
if KILL_PHASE is not None and KILL_PHASE not in CKPT_PHASES:
    raise ValueError(f"K3_FAULT_KILL_IN_CKPT_PHASE={KILL_PHASE!r} must be one of {'|'.join(CKPT_PHASES)}")


def _mine(rank: int) -> bool:
    return FAULT_RANK is None or FAULT_RANK == rank


class _InfGrad(torch.autograd.Function):
    """Identity forward; the backward turns the incoming gradient into +inf (finite loss, non-finite grads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g * float("inf")


def poison_loss(loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """The loss of (1-based) `step`, poisoned when a NaN/Inf fault targets this step and rank."""
    if not ACTIVE or not _mine(rank):
        return loss
    if step in NAN_STEPS:
        return loss * float("nan")
    if step in INF_GRAD_STEPS:
        return _InfGrad.apply(loss)
    return loss


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9: no cleanup, no flush, no atexit


def after_step(step: int, rank: int) -> None:
    """Kill point right after optimizer step `step` (and its metrics line), before its checkpoint."""
    if KILL_STEPS and KILL_PHASE is None and step in KILL_STEPS and _mine(rank):
        _kill()


def checkpoint_phase(phase: str, step: int, rank: int) -> None:
    """Kill point inside the checkpoint write of `step` (called by training/checkpoint.py at each phase)."""
    if KILL_PHASE == phase and step in KILL_STEPS and _mine(rank):
        _kill()


def free_bytes(path: str) -> int:
    """Free bytes on `path`'s filesystem; K3_FAULT_DISK_FREE_BYTES fakes a full disk in tests."""
    fake = os.environ.get("K3_FAULT_DISK_FREE_BYTES")
    if fake:
        return int(fake)
    import shutil

    return int(shutil.disk_usage(path).free)
