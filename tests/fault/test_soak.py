"""Fault 9, soak: a long 1-rank tiny job keeps resident memory flat after warm-up (< 5% growth), opens no file
handles per step, and writes a well-formed metrics file. CI runs 150 steps; the matrix runs 2,000."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import REPO, job_env
from tests.fault.conftest import FULL, TINY, record

FD_SLACK = 3  # W&B/datasets may open a file lazily once; growth per step would be hundreds


def _proc_sample(pid: int) -> tuple[int, int] | None:
    try:
        rss = next(
            int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:")
        )
        return rss * 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


def soak(run_dir: Path, steps: int) -> dict:
    """Run the job, sampling (step, RSS, open fds) of the training process from outside."""
    cmd = [
        sys.executable,
        "-m",
        "training.train",
        f"run_dir={run_dir}",
        *TINY,
        f"train.steps={steps}",
        "logging.every=10",
        "logging.heatmap_every=500",
        f"checkpoint.every={max(50, steps // 4)}",
        "checkpoint.keep_last=2",
        "logging.progress=false",
    ]
    p = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples, metrics_path = [], run_dir / "metrics.jsonl"
    while p.poll() is None:
        s = _proc_sample(p.pid)
        if s and metrics_path.is_file():
            lines = metrics_path.read_bytes().count(b"\n")
            samples.append((lines * 10, *s))
        time.sleep(0.25)
    err = p.stderr.read()
    return {
        "rc": p.returncode,
        "stderr": err[-3000:],
        "samples": samples,
        "metrics": list(metrics_path.read_text().splitlines()) if metrics_path.is_file() else [],
    }


def _check(res: dict, steps: int, label: str) -> None:
    assert res["rc"] == 0, res["stderr"]
    records = [json.loads(ln) for ln in res["metrics"]]  # every line is strict JSON
    assert [r["step"] for r in records] == list(range(10, steps + 1, 10))
    assert all(isinstance(r["loss"], float) and math.isfinite(r["loss"]) for r in records)
    warm = [s for s in res["samples"] if steps * 0.3 <= s[0] < steps]  # (not the shutdown)
    assert len(warm) >= 4, f"too few samples after warm-up: {len(warm)}"
    rss0 = sorted(s[1] for s in warm[: len(warm) // 4 or 1])[len(warm[: len(warm) // 4 or 1]) // 2]
    rss_end = max(s[1] for s in warm[-(len(warm) // 4 or 1) :])
    growth = rss_end / rss0 - 1
    fds = [s[2] for s in warm]
    record(
        label,
        survived=growth < 0.05 and max(fds) - min(fds) <= FD_SLACK,
        data_lost=False,
        detail=f"rss {rss0 / 2**20:.0f}->{rss_end / 2**20:.0f} MiB ({growth:+.2%}), fds {min(fds)}..{max(fds)}",
    )
    print(
        f"soak {steps} steps: rss {rss0 / 2**20:.1f} -> {rss_end / 2**20:.1f} MiB ({growth:+.2%}), "
        f"fds {min(fds)}..{max(fds)}"
    )
    assert growth < 0.05, f"RSS grew {growth:.1%} after warm-up"
    assert max(fds) - min(fds) <= FD_SLACK, f"open files grew {min(fds)} -> {max(fds)}"


def test_short_soak_memory_files_and_metrics(tmp_path):
    _check(soak(tmp_path / "soak", 150), 150, "soak 150 steps")


@pytest.mark.fault_matrix
def test_soak_2000_steps(tmp_path):
    assert FULL
    _check(soak(tmp_path / "soak", 2000), 2000, "soak 2000 steps")
