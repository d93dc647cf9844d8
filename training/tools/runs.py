"""A run directory as data for the reports: its metrics merged by step with a token count on every record, its
resolved config flattened, and the final and best value of each metric.

Why here and not in the report modules: the single-run report and the multi-run page read runs the same way
(numpy + PyYAML only, no torch). The contract with the trainer and the evaluator: records in `<run>/metrics.jsonl`
with `step`; training records carry `tokens_seen` (else `tokens` per step, else the run's tokens per step from
`summary.json`, else `micro_batch_size x grad_accum x seq_len` of `config.yaml`, data-parallel size 1 assumed);
eval records carry `eval/<set or task>/<metric>` keys and may be records of their own at a training step.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from training.metrics.sinks import read_jsonl

SKIP_DIRS = ("archive", "checkpoints", "wandb", "report", "model", "multirun")  # never a run inside a run
NOT_COMPARED = ("run_dir",)  # config keys that differ between any two runs and say nothing
_MIN_METRIC = re.compile(r"^(loss|ppl|bpb|loss_pos/.*|.*_loss)$")
_MAX_METRIC = re.compile(r"^(acc|acc_norm|acc@.*|logprob@.*)$")


def merge_by_step(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step: records at the same step merge (a training record and the eval record logged at its
    step), and for each key the LAST written value wins (a resumed run re-logs the steps after its checkpoint)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if "step" in r:
            by_step.setdefault(int(r["step"]), {}).update(r)
    return [by_step[s] for s in sorted(by_step)]


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested config -> {"a.b.c": leaf}; lists stay leaves (shown as JSON), an empty mapping is a leaf `{}`."""
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree} if prefix else {}


def differing_keys(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Flat keys whose value is not the same in every config (a key one config lacks differs), sorted."""
    keys = sorted({k for c in configs for k in c} - set(NOT_COMPARED))
    missing = object()
    return [k for k in keys if len({json.dumps(c.get(k, missing), default=str) for c in configs}) > 1]


def direction(key: str) -> str | None:
    """'min' or 'max' for a metric with a better side (losses, perplexity, bits per byte, accuracies and
    log-probabilities of eval tasks), None for one that only has a final value (lr, throughput, router)."""
    if key in ("loss", "loss_avg"):
        return "min"
    if not key.startswith("eval/"):
        return None
    metric = key.split("/", 2)[2] if key.count("/") >= 2 else ""
    if _MIN_METRIC.match(metric):
        return "min"
    if _MAX_METRIC.match(metric):
        return "max"
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Run:
    """One run directory read for a report: `records` merged by step, each with a `tokens` x-value."""

    path: Path
    name: str
    records: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)  # flattened config.yaml ({} without one)
    summary: dict[str, Any] = field(default_factory=dict)
    tokens_note: str = ""  # how the token axis was derived where the records do not carry it
    _keys: set[str] | None = field(default=None, repr=False)

    def series(self, key: str, x: str = "tokens") -> tuple[np.ndarray, np.ndarray]:
        pts = [(r[x], r[key]) for r in self.records if _number(r.get(key)) and _number(r.get(x))]
        if not pts:
            return np.zeros(0), np.zeros(0)
        xs, ys = zip(*pts)
        return np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)

    def metric_keys(self) -> set[str]:
        """Every key with a numeric value in some record (computed once: the records do not change)."""
        if self._keys is None:
            self._keys = {k for r in self.records for k, v in r.items() if _number(v)}
        return self._keys

    def final(self, key: str) -> tuple[float, int] | None:
        """(last value, its step)."""
        for r in reversed(self.records):
            if _number(r.get(key)):
                return float(r[key]), int(r["step"])
        return None

    def best(self, key: str) -> tuple[float, int] | None:
        """(best value, its step) by `direction(key)` (the first step reaching it); None where no side is better."""
        how = direction(key)
        pts = [(float(r[key]), int(r["step"])) for r in self.records if _number(r.get(key))]
        if how is None or not pts:
            return None
        return min(pts, key=lambda p: (p[0] if how == "min" else -p[0], p[1]))


def _tokens_per_step(config: Mapping[str, Any], summary: Mapping[str, Any]) -> tuple[float | None, str]:
    if _number(summary.get("tokens_seen")) and _number(summary.get("steps")) and summary["steps"] > 0:
        return summary["tokens_seen"] / summary["steps"], "tokens from summary.json (tokens_seen / steps)"
    keys = ("train.micro_batch_size", "train.grad_accum", "train.seq_len")
    if all(_number(config.get(k)) for k in keys):
        n = math.prod(config[k] for k in keys)
        return float(n), "tokens estimated from config.yaml (micro_batch_size x grad_accum x seq_len, 1 data rank)"
    return None, "no token count: x = step"


def add_tokens(records: list[dict[str, Any]], config: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    """Give every record a `tokens` x-value (tokens trained up to its step); returns how it was derived where a
    record lacks `tokens_seen`. Order: the record's `tokens_seen`; the running sum of per-step counts
    (`tokens_step`) over consecutive steps; the step times the run's tokens per step (`_tokens_per_step`); the
    step times the record's own per-step count; the step."""
    per_step, note = None, ""
    if any(not _number(r.get("tokens_seen")) for r in records):
        per_step, note = _tokens_per_step(config, summary)
    total, last_step, used = 0.0, 0, set()
    for r in records:
        step = int(r["step"])
        if _number(r.get("tokens_seen")):
            total = float(r["tokens_seen"])
        elif _number(r.get("tokens_step")) and step == last_step + 1:
            total += r["tokens_step"]  # an unbroken run of per-step counts: their sum is exact
            used.add("tokens from the per-step counts")
        elif per_step is not None:
            total = per_step * step
            used.add(note)
        elif _number(r.get("tokens_step")):
            total = r["tokens_step"] * step
            used.add("tokens estimated as the step's own count x step")
        else:
            total = float(step)
            used.add(note)
        r["tokens"] = total
        last_step = step
    return "; ".join(sorted(used))


def load_run(path: str | Path, name: str | None = None) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} not found; pass a run directory written by training.train")
    records = merge_by_step(read_jsonl(metrics))
    for r in records:  # the per-step count, kept apart from the cumulative x-value `tokens`
        if "tokens" in r:
            r["tokens_step"] = r.pop("tokens")
    config: dict[str, Any] = {}
    if (path / "config.yaml").is_file():
        import yaml  # PyYAML (OmegaConf's own dependency)

        config = flatten(yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {})
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    note = add_tokens(records, config, summary)
    return Run(path, name or path.name, records, config, summary, note)


def find_runs(paths: Sequence[str | Path], max_depth: int = 3) -> list[Path]:
    """Run directories: each path that holds a metrics.jsonl, or else every run directory below it (a sweep's
    folder), in sorted order; a path with neither is an error naming it."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            out.append(p)
            continue
        found = sorted(_runs_below(p, max_depth)) if p.is_dir() else []
        if not found:
            raise FileNotFoundError(
                f"{p / 'metrics.jsonl'} not found and no run directory below {p}; pass run directories written "
                "by training.train (or a sweep's folder of them)"
            )
        out += found
    return list(dict.fromkeys(out))


def _runs_below(p: Path, depth: int) -> list[Path]:
    if depth <= 0:
        return []
    out = []
    for child in p.iterdir():
        if not child.is_dir() or child.name in SKIP_DIRS or child.name.startswith("."):
            continue
        if (child / "metrics.jsonl").is_file():
            out.append(child)
        else:
            out += _runs_below(child, depth - 1)
    return out


def short_names(paths: Sequence[Path]) -> list[str]:
    """The shortest trailing parts of the paths that tell them apart (runs/sweep/lr-1 and runs/other/lr-1:
    sweep/lr-1, other/lr-1)."""
    parts = [p.resolve().parts for p in paths]
    for n in range(1, max(len(x) for x in parts) + 1):
        names = ["/".join(x[-n:]) for x in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]
