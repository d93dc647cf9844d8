"""Fixtures shared by the training tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def real_run(tmp_path_factory):
    """A real 1-process tiny training run (4 steps, heatmaps every 2), made once for the report and generation tests."""
    run_dir = tmp_path_factory.getbasetemp() / "k3_real_tiny_run"
    if not (run_dir / "summary.json").is_file():
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "training.train",
                "experiment=tiny_ci",
                f"run_dir={run_dir}",
                "logging.mode=disabled",
                "train.steps=4",
                "logging.heatmap_every=2",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-2000:]
    return run_dir
