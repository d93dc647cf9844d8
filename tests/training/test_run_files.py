"""What a run directory and the console tell a person: the effective config, a world-size-free DeepSpeed JSON,
a console line for every logging step, an honest tokens/s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run_files") / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.train",
            "experiment=tiny_ci",
            f"run_dir={run_dir}",
            f"train.steps={STEPS}",
            "logging.every=1",
            "logging.mode=disabled",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return run_dir, p


def test_config_yaml_records_the_model_as_built(run):
    run_dir, _ = run
    saved = OmegaConf.load(run_dir / "config.yaml").model
    built = json.loads((run_dir / "model" / "config.json").read_text())
    assert saved.hidden_size is not None and saved.num_experts is not None
    for key, value in saved.items():
        if key in built:
            assert value == built[key], key


def test_ds_config_json_is_valid_for_any_world_size(run):
    ds = json.loads((run[0] / "ds_config.json").read_text())
    assert "train_batch_size" not in ds and ds["train_micro_batch_size_per_gpu"] >= 1


def test_console_shows_every_logging_step(run):
    _, p = run
    lines = [ln for ln in p.stderr.splitlines() + p.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == [f"{s}/{STEPS}" for s in range(1, STEPS + 1)]


def test_summary_tokens_per_s_is_this_sessions_tokens_over_its_time(run):
    summary = json.loads((run[0] / "summary.json").read_text())
    assert summary["session_tokens"] == summary["tokens_seen"]  # a fresh run: this session saw every token
    assert summary["tokens_per_s"] == pytest.approx(summary["session_tokens"] / summary["elapsed_s"], rel=1e-6)


def test_checkpoints_say_how_to_convert_them(run):
    note = (run[0] / "checkpoints" / "README.md").read_text()
    assert "python -m training.export" in note and "zero_to_fp32.py" in note


def test_torch_threads_follow_omp_num_threads_when_set(run):
    assert json.loads((run[0] / "summary.json").read_text())["torch_threads"] == 1  # the fixture sets it to 1


def test_cpu_threads_default_to_the_cores_per_local_rank(monkeypatch):
    from training.train import cpu_threads_per_rank

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_SIZE", "2")  # what the deepspeed launcher sets
    assert cpu_threads_per_rank() == max(1, cores // 2)
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu_threads_per_rank() == cores


def test_a_run_without_omp_num_threads_uses_every_core_of_its_rank(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.train",
            "experiment=tiny_ci",
            f"run_dir={tmp_path / 'r'}",
            "train.steps=1",
            "logging.mode=disabled",
        ],
        cwd=REPO,
        env={**env, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["torch_threads"] == len(os.sched_getaffinity(0))
