"""Rank-0 progress bar: step count, loss, tokens/s and ETA (tqdm), plus the final summary line.

Why a wrapper: the trainer stays free of tqdm details, and a non-interactive run (CI, Slurm logs) gets plain
occasional lines instead of carriage-return spam.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm import tqdm


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def format_summary(values: Mapping[str, Any]) -> str:
    """One line `summary: k=v k=v ...` with floats at 4 significant digits."""
    parts = []
    for k, v in values.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return "summary: " + " ".join(parts)


class Progress:
    """A tqdm bar over [start_step, total_steps] (interactive) or one line per update (otherwise)."""

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
        min_interval_s: float = 0.0,
    ) -> None:
        self.stream = stream or sys.stderr
        self.total, self.start = total_steps, start_step
        self.enabled = enabled
        self.interactive = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = None
        self._t0 = time.perf_counter()
        self._last_print = 0.0
        self._min_interval = min_interval_s
        self.step = start_step
        if self.interactive:
            self._bar = tqdm(
                total=total_steps, initial=start_step, file=self.stream, dynamic_ncols=True, unit="step", desc="train"
            )

    def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        if not self.enabled:
            return
        done = step - self.step
        self.step = step
        post = {}
        if loss is not None:
            post["loss"] = f"{loss:.4f}"
        if tokens_per_s is not None:
            post["tok/s"] = f"{tokens_per_s:,.0f}"
        if self._bar is not None:
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(done)
            return
        now = time.perf_counter()
        if now - self._last_print < self._min_interval and step < self.total:
            return
        self._last_print = now
        rate = (step - self.start) / max(now - self._t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        eta_s = format_duration(eta) if eta != float("inf") else "?"
        extra = " ".join(f"{k}={v}" for k, v in post.items())
        print(f"step {step}/{self.total} {extra} eta={eta_s}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
