"""Timing helpers shared by every benchmark: medians of repetitions, spread, a table, JSON under bench/results/.

The machines are shared and noisy, so a benchmark reports the median of several repetitions with the spread
(min..max) and compares against a peer measured *in the same run* (a ratio), never an absolute wall-clock goal.
`peak_matmul_flops` measures the large-fp32-matmul rate of this machine, the denominator of "CPU MFU".
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

# K3_BENCH_RESULTS redirects the JSON (tests/test_documented_commands.py runs benches without touching results/)
RESULTS_DIR = Path(os.environ.get("K3_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


@dataclass
class Timing:
    """Seconds per call over `reps` repetitions (after warm-up)."""

    median: float
    min: float
    max: float
    reps: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the measurement was."""
        return (self.max - self.min) / self.median if self.median > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "spread": self.spread}


def time_fn(fn: Callable[[], Any], reps: int = 5, warmup: int = 1) -> Timing:
    """Median wall time of `fn()` over `reps` calls after `warmup` calls (CUDA synchronised when used)."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), min(times), max(times), reps)


def time_interleaved(
    fns: dict[str, Callable[[], Any]], reps: int | dict[str, int] = 5, warmup: int = 1
) -> dict[str, Timing]:
    """Time several peers round-robin (one call of each per round), so load changes hit them all alike.

    `reps` may be a per-peer dict (a slow peer can take fewer rounds than a fast one).
    """
    per = {name: (reps[name] if isinstance(reps, dict) else reps) for name in fns}
    if any(r < 1 for r in per.values()):
        raise ValueError(f"reps must be >= 1 for every peer, got {per}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(max(per.values())):
        for name, fn in fns.items():
            if rnd < per[name]:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: Timing(statistics.median(t), min(t), max(t), len(t)) for name, t in times.items()}


def peak_matmul_flops(
    n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> float:
    """FLOP/s of a large square matmul (2 n^3 FLOPs per call), median of `reps`: this machine's practical peak."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = time_fn(lambda: a @ b, reps=reps, warmup=1)
    return 2 * n**3 / t.median


def rank_job_env() -> dict[str, str]:
    """The environment of a bench's launcher job whose ranks report their heap peaks: CPU accelerator, one thread
    a rank, this checkout first on the path, no inherited RANK, and a fixed 128 KiB mmap threshold (glibc then
    returns every large block on free, so the heap tracks live tensors)."""
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(Path(__file__).resolve().parent.parent),
        MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"),
    )
    env.pop("RANK", None)
    return env


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform.processor() elsewhere): every number names it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_table(rows: Sequence[dict[str, Any]], columns: Iterable[str] | None = None) -> str:
    """Plain-text table; floats get 4 significant digits."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns is not None else list(rows[0])

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.rjust(w) for c, w in zip(cols, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([line, sep, *body])


def print_table(title: str, rows: Sequence[dict[str, Any]], columns: Iterable[str] | None = None) -> None:
    print(f"\n{title}\n{format_table(rows, columns)}", flush=True)


def write_json(name: str, payload: dict[str, Any], results_dir: str | os.PathLike | None = None) -> Path:
    """Write `payload` (plus machine info) to bench/results/<name>.json and return the path."""
    out_dir = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"name": name, "machine": machine_info(), **payload}, f, indent=2, sort_keys=False)
        f.write("\n")
    return path
