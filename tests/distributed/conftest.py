"""Helpers to run real training jobs: the `deepspeed` launcher (N CPU ranks) or `python -m training.train`.

Each run gets its own run_dir and master port; results come back as a `RunResult` with metrics.jsonl parsed.
Runs are expensive (launcher start-up ~5 s), so tests share them through module-scoped fixtures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from training.launch import launch_command

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    metrics: list[dict] = field(default_factory=list)

    def losses(self) -> dict[int, float]:
        """step -> loss; on a resumed run (appended records) the LAST record of a step wins."""
        return {int(r["step"]): r["loss"] for r in self.metrics if "loss" in r}

    def tail(self, n: int = 3000) -> str:
        return f"rc={self.returncode}\n--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        WANDB_SILENT="true",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
        # the virtualenv's bin first, as launch/smoke.sh and `make ops` run: its `ninja` builds DeepSpeed's CPU Adam
        # (another ninja version would see `make ops`' build as stale and rebuild it, ~90 CPU-s)
        PATH=os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", ""))),
    )
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.update(extra or {})
    return env


def run_training(
    run_dir: Path,
    overrides: list[str],
    nproc: int = 2,
    env: dict[str, str] | None = None,
    launcher: bool = True,
    timeout: int = 600,
    script: str = "training/train.py",
) -> RunResult:
    """One training job; `launcher=False` runs `python -m training.train` (a 1-rank gloo group); `script`: what
    the launcher starts (a test worker taking the same overrides).

    A K3_FAULT_* variable in `env` plugs the test-only fault injector (tests/fault/injector.py) into the trainer's
    callback seam; production code never imports it."""
    args = [f"run_dir={run_dir}", *overrides]
    if any(k.startswith("K3_FAULT_") for k in (env or {})):
        args.append("callbacks=[tests.fault.injector.FaultInjector]")
    if launcher:
        cmd = launch_command(args, nproc, script)  # a free master port: tests never meet another job's ranks
    else:
        cmd = [sys.executable, "-m", "training.train", *args]
    p = subprocess.run(cmd, cwd=REPO, env=job_env(env), capture_output=True, text=True, timeout=timeout)
    return RunResult(p.returncode, p.stdout, p.stderr, Path(run_dir), read_metrics(Path(run_dir)))


def must_succeed(res: RunResult) -> RunResult:
    assert res.returncode == 0, res.tail()
    return res


# The smallest job that still has KDA, MLA, dense and MoE layers (conf/experiment/tiny_ci.yaml). W&B stays off
# (metrics.jsonl has every record either way; an offline W&B run costs ~3 s of CPU per job), except in the jobs whose
# tests read the W&B run: TINY_WANDB.
TINY = ["experiment=tiny_ci", "logging.mode=disabled"]
TINY_WANDB = ["experiment=tiny_ci", "logging.mode=offline"]


@pytest.fixture(scope="session")
def runs_root():
    """Own temp dir (not pytest's tmp_path: concurrent pytest sessions prune each other's old base dirs)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="k3-train-runs-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


# Shared by test_zero, test_resume and test_layouts: 2 ranks, ZeRO-2, DP=2 x GA=1, checkpoints every 3 steps.
REF_STEPS = 6
REF = [
    *TINY_WANDB,
    "deepspeed=zero2",
    f"train.steps={REF_STEPS}",
    "checkpoint.every=3",
    "train.grad_accum=1",
    "train.micro_batch_size=2",
]


@pytest.fixture(scope="session")
def ref_run(runs_root) -> RunResult:
    """The uninterrupted 2-rank reference job."""
    return must_succeed(run_training(runs_root / "ref_zero2", REF, nproc=2))


# The EP=2 job: 2 ranks, ZeRO-2, parallel=ep2, global batch 4 rows, checkpoints every 2 steps (the last 2 kept). Its
# uninterrupted run is the session fixture `ep2_ref` (tests/conftest.py).
EP2_STEPS = 8
EP2_JOB = [
    *TINY,
    "deepspeed=zero2",
    "parallel=ep2",
    f"train.steps={EP2_STEPS}",
    "checkpoint.every=2",
    "train.micro_batch_size=2",
    "train.grad_accum=1",
    "checkpoint.keep_last=2",
]
