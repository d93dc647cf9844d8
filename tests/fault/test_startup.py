"""Fault 7: an unwritable run directory or a full disk is an error before training starts (exit 2, one line,
nothing trained, no process group)."""

from __future__ import annotations

from tests.fault.conftest import TINY, run_training

JOB = [*TINY, "train.steps=2"]


def _one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1, r.tail()
    assert "step 1" not in r.stdout and "resumed" not in r.stdout
    return lines[0]


def test_unwritable_run_dir_fails_before_training():
    r = run_training("/sys/k3-fault-unwritable-run", JOB, launcher=False)  # read-only even for root
    assert "run_dir /sys/k3-fault-unwritable-run is not writable" in _one_error_line(r)


def test_run_dir_below_a_regular_file_fails_before_training(tmp_path):
    (tmp_path / "afile").write_text("x")
    r = run_training(tmp_path / "afile" / "run", JOB, launcher=False)
    assert "is not writable" in _one_error_line(r)


def test_full_disk_fails_before_training(tmp_path):
    # more kept checkpoints than any disk holds: the real free-space check refuses before anything is written
    r = run_training(tmp_path / "run", [*JOB, "checkpoint.keep_last=1000000000"], launcher=False)
    line = _one_error_line(r)
    assert "MiB free" in line and "checkpoint.keep_last" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()
