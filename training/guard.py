"""Non-finite step guard: a NaN/Inf loss or gradient skips the optimizer step instead of poisoning the weights.

How a step is skipped without touching weights, optimizer moments or the LR schedule:
- ZeRO 1/2/3 optimizers already refuse a step whose global gradient norm is not finite (they zero the gradients
  and set `optimizer.overflow`; the engine then counts `skipped_steps` and does not advance the LR schedule).
- A plain client optimizer (ZeRO-0) has no such check: `install` wraps its `step` with one collective finiteness
  check (MAX over all ranks) and sets the same `overflow` attribute, so the engine behaves identically.
A non-finite loss always reaches the gradients (NaN/Inf propagate through backward), so the gradient check covers it;
`after_step` additionally treats a non-finite global loss as a bad step. On a skipped step the trainer does not
hand the bad forward's routing statistics to the balancers (router biases untouched). After `max_bad_steps`
consecutive bad steps the trainer saves a checkpoint and stops with `TooManyBadSteps`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist


class TooManyBadSteps(RuntimeError):
    """Raised after `max_bad_steps` consecutive skipped steps; the message is one line naming the fix."""


def grads_finite(params: list[torch.Tensor]) -> bool:
    """Whether every existing .grad is finite (one fused reduction per tensor, no host sync per tensor)."""
    bad = torch.zeros((), dtype=torch.bool)
    for p in params:
        if p.grad is not None:
            bad |= ~torch.isfinite(p.grad).all().cpu()
    return not bool(bad)


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def install(engine) -> bool:
    """Give a plain torch optimizer (ZeRO-0) the finiteness check ZeRO optimizers have; True if wrapped."""
    opt = engine.optimizer
    if opt is None or hasattr(opt, "overflow") or not isinstance(opt, torch.optim.Optimizer):
        return False
    inner_step = opt.step
    opt.overflow = False

    @functools.wraps(inner_step)  # keeps torch's LR-scheduler marker on step (no "step() overridden" warning)
    def guarded_step(*args: Any, **kwargs: Any):
        params = [p for g in opt.param_groups for p in g["params"]]
        opt.overflow = _any_rank(not grads_finite(params))
        if opt.overflow:
            opt.zero_grad(set_to_none=True)
            return None
        return inner_step(*args, **kwargs)

    opt.step = guarded_step  # type: ignore[method-assign]
    return True


class StepGuard:
    """Counts skipped steps and enforces the consecutive-bad-step limit (identical decision on every rank)."""

    def __init__(self, max_bad_steps: int) -> None:
        self.max_bad_steps = int(max_bad_steps)
        self.skipped_steps = 0
        self.consecutive = 0

    def after_step(self, step: int, applied: bool, loss: float) -> bool:
        """Record optimizer step `step`; returns True if it was skipped. `applied` is engine.was_step_applied()."""
        if _any_rank(not applied) and applied:  # one collective: every rank must have made the same decision
            raise TooManyBadSteps(
                f"step {step}: the optimizer step was skipped on some ranks but applied here; "
                "the ranks' weights diverged: resume from the last checkpoint"
            )
        bad = (not applied) or not math.isfinite(loss)
        if bad and applied:  # cannot happen with ZeRO or `install`; fail loudly rather than train on garbage
            raise TooManyBadSteps(
                f"step {step}: loss {loss} is not finite but the optimizer step was applied; "
                "enable gradient checks (deepspeed zero_optimization.compute_grad_norm=true)"
            )
        if bad:
            self.skipped_steps += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        return bad

    @property
    def exhausted(self) -> bool:
        return self.max_bad_steps > 0 and self.consecutive >= self.max_bad_steps

    def message(self, step: int, ckpt: str | None) -> str:
        where = f"; checkpoint {ckpt} holds the weights of the last good step" if ckpt else ""
        return (
            f"stopping at step {step}: {self.consecutive} consecutive non-finite steps "
            f"(train.max_bad_steps={self.max_bad_steps}){where}; lower optim.lr, check the data, or raise "
            "train.max_bad_steps"
        )

    def state_dict(self) -> dict[str, int]:
        return {"skipped_steps": self.skipped_steps, "consecutive_bad_steps": self.consecutive}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.skipped_steps = int(st.get("skipped_steps", 0))
        self.consecutive = int(st.get("consecutive_bad_steps", 0))
