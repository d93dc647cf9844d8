"""The console entry points (k3-train, k3-plan, k3-report, k3-export, k3-generate) and `python -m training.*`
work from any working directory, even one holding its own data/ and model/ folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def foreign_cwd(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("foreign_cwd")
    for name in ("data", "model", "training"):
        (d / name).mkdir()
        (d / name / "notes.txt").write_text("a user's own folder, not a package\n")
    return d


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", [["k3-plan", "model=tiny"], ["python", "-m", "training.plan", "model=tiny"]])
def test_planner_runs_from_a_directory_with_its_own_data_and_model_folders(cmd, foreign_cwd):
    exe = [str(BIN / cmd[0])] if cmd[0].startswith("k3-") else [sys.executable]
    p = _run([*exe, *cmd[1:]], foreign_cwd)
    assert p.returncode == 0 and "throughput" in p.stdout, p.stderr[-2000:]


def test_train_report_export_generate_entry_points_from_a_foreign_directory(foreign_cwd):
    run = foreign_cwd / "runs" / "tiny"
    p = _run(
        [str(BIN / "k3-train"), "experiment=tiny_ci", "train.steps=2", f"run_dir={run}", "logging.mode=disabled"],
        foreign_cwd,
    )
    assert p.returncode == 0 and (run / "summary.json").is_file(), p.stderr[-2000:]
    p = _run([str(BIN / "k3-report"), str(run)], foreign_cwd)
    assert p.returncode == 0 and (run / "report" / "index.html").is_file(), p.stderr[-2000:]
    p = _run([str(BIN / "k3-export"), str(run), str(foreign_cwd / "hf")], foreign_cwd)
    assert p.returncode == 0 and (foreign_cwd / "hf" / "config.json").is_file(), p.stderr[-2000:]
    p = _run([str(BIN / "k3-generate"), str(foreign_cwd / "hf"), "prompt_ids=1 2 3", "max_new_tokens=2"], foreign_cwd)
    assert p.returncode == 0 and p.stdout.startswith("1 2 3"), p.stderr[-2000:]
