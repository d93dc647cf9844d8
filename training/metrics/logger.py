"""RunLogger: the trainer's single logging object (rank 0 writes; other ranks get no-ops).

Files in run_dir: `metrics.jsonl` (one object per logged step; appended on resume), `expert_load.jsonl`
(full-resolution layers x experts loads every `heatmap_every` steps), `summary.json`, `wandb_run_id`, `wandb/`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.metrics.progress import Progress, format_summary
from training.metrics.sinks import JsonlSink, WandbSink, to_jsonable

if TYPE_CHECKING:
    import torch

MODES = ("offline", "online", "disabled")
RUN_ID_FILE = "wandb_run_id"


class RunLogger:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: Mapping[str, Any],
        mode: str = "offline",
        project: str = "k3-train",
        run_id: str | None = None,
        total_steps: int = 0,
        is_main: bool = True,
        heatmap_every: int = 100,
        resume: bool = False,
        start_step: int = 0,
        progress: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"logging mode {mode!r} is not one of {MODES}; set logging.mode=offline|online|disabled")
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.heatmap_every = int(heatmap_every)
        self._last_heatmap: int | None = None
        self._run_id = run_id
        self._wandb: WandbSink | None = None
        self._metrics: JsonlSink | None = None
        self._loads: JsonlSink | None = None
        self._progress: Progress | None = None
        self._defined: set[str] = set()  # W&B metrics given a best-value summary (log_eval)
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        id_file = self.run_dir / RUN_ID_FILE
        if run_id is None and resume and id_file.is_file():
            self._run_id = id_file.read_text().strip() or None
        self._metrics = JsonlSink(self.run_dir / "metrics.jsonl", append=resume)
        self._loads = JsonlSink(self.run_dir / "expert_load.jsonl", append=resume)
        if mode != "disabled":
            group = (config.get("logging") or {}).get("group")  # the run config's logging.group (sweeps set it)
            self._wandb = WandbSink(self.run_dir, config, mode, project, self._run_id, resume, group)
            self._run_id = self._wandb.run_id
            id_file.write_text(self._run_id + "\n")
        self._progress = Progress(total_steps, start_step, enabled=progress)

    @property
    def run_id(self) -> str | None:
        """The W&B run id (store it in the checkpoint so a resume continues the same W&B run)."""
        return self._run_id

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One record {step, time, **metrics} to metrics.jsonl and W&B; advances the progress bar."""
        if not self.is_main:
            return
        record = self._write(step, metrics)
        if self._progress is not None:
            # the window mean (loss_avg) when the trainer provides it: single-step losses are noisy
            loss, tps = record.get("loss_avg", record.get("loss")), record.get("tokens_per_s")
            self._progress.update(
                int(step),
                loss if isinstance(loss, (int, float)) else None,
                tps if isinstance(tps, (int, float)) else None,
            )

    def log_eval(self, step: int, metrics: Mapping[str, Any], best: Mapping[str, str] | None = None) -> None:
        """One evaluation record {step, time, **metrics} (metrics.jsonl, W&B on the step axis), no progress bar.
        `best`: metric -> "min" | "max", the W&B summary keeps that metric's best value (defined once per key)."""
        if not self.is_main:
            return
        if self._wandb is not None:
            for key, goal in (best or {}).items():
                if key not in self._defined:
                    self._wandb.run.define_metric(key, step_metric="step", summary=goal)
                    self._defined.add(key)
        self._write(step, metrics)

    def _write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """One record {step, time, **metrics} to metrics.jsonl and W&B (main rank only); returns it."""
        record = {"step": int(step), "time": time.time(), **to_jsonable(dict(metrics))}
        assert self._metrics is not None
        self._metrics.write(record)
        if self._wandb is not None:
            self._wandb.log(step, {k: v for k, v in record.items() if k not in ("step", "time")})
        return record

    def heatmap_due(self, step: int) -> bool:
        """True on the first call and then every >= heatmap_every steps (heatmap_every <= 0 disables)."""
        if self.heatmap_every <= 0:
            return False
        return self._last_heatmap is None or step - self._last_heatmap >= self.heatmap_every

    def log_heatmap(self, step: int, counts_LE: torch.Tensor, layer_ids: Sequence[int] | None = None) -> bool:
        """Expert loads [n_moe_layers, E]: full resolution to expert_load.jsonl, one bucketed image (<= 128
        columns) to W&B. Returns whether it logged (see heatmap_due)."""
        if not self.is_main or not self.heatmap_due(step):
            return False
        self._last_heatmap = int(step)
        counts = counts_LE.detach().cpu()
        ids = list(layer_ids) if layer_ids is not None else list(range(counts.shape[0]))
        assert self._loads is not None
        self._loads.write({"step": int(step), "layer_ids": ids, "expert_load": counts.tolist()})
        if self._wandb is not None:
            self._wandb.log_heatmap(step, counts, caption=f"step {step}: layers x experts, load / layer mean")
        return True

    def summary(self, values: Mapping[str, Any]) -> str:
        """Final summary: one printed line, summary.json, and the W&B run summary. Returns the line."""
        if not self.is_main:
            return ""
        vals = to_jsonable(dict(values))
        line = format_summary(vals)
        if self._progress is not None:
            self._progress.close()
        print(line, file=sys.stdout, flush=True)
        (self.run_dir / "summary.json").write_text(json.dumps(vals, indent=1, sort_keys=True) + "\n")
        if self._wandb is not None:
            self._wandb.summary(vals)
        return line

    def close(self) -> None:
        if not self.is_main:
            return
        if self._progress is not None:
            self._progress.close()
        for sink in (self._metrics, self._loads):
            if sink is not None:
                sink.close()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
