"""Faults 5 and 8: corrupted/truncated/malicious checkpoints and secrets.

Loading never executes pickled code (weights-only everywhere, DeepSpeed's loader included); a damaged file is a
one-line error naming it; `checkpoint.fallback=true` resumes from the previous complete checkpoint instead; the
W&B API key never lands in the run directory or the logs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import REPO, job_env
from tests.fault.conftest import BASE_STEPS, SECRET, ckpt_dir, copy_run, resume_overrides, run_training
from training.checkpoint.safe_load import CheckpointError, safe_torch_load, verify_checkpoint


class _Payload:
    """Unpickling this calls os.system: the canary file appears iff pickled code ran."""

    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def plant_malicious(path: Path, canary: Path) -> None:
    torch.save({"rng": _Payload(canary), "data": None}, path)


def test_plain_torch_load_would_run_the_payload(tmp_path):
    """The planted file is really dangerous: an unsafe load executes it (so the refusal below means something)."""
    canary = tmp_path / "pwned"
    plant_malicious(tmp_path / "evil.pt", canary)
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert canary.exists()


def test_safe_load_refuses_pickled_code_and_names_the_file(tmp_path):
    canary = tmp_path / "pwned"
    plant_malicious(tmp_path / "evil.pt", canary)
    with pytest.raises(CheckpointError) as e:
        safe_torch_load(str(tmp_path / "evil.pt"))
    msg = str(e.value)
    assert "evil.pt" in msg and "pickled code" in msg and "\n" not in msg
    assert not canary.exists()


@pytest.mark.parametrize("damage", ["truncate", "empty", *(f"garbage{seed}" for seed in range(8))])
def test_damaged_file_is_one_line_error_naming_it(tmp_path, damage):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.randn(64, 64)}, path)
    data = path.read_bytes()
    if damage.startswith("garbage"):  # seeded random bytes: the unpickler fails differently for each
        data = random.Random(int(damage[len("garbage") :])).randbytes(len(data))
    path.write_bytes({"truncate": data[: len(data) // 2], "empty": b""}.get(damage, data))
    with pytest.raises(CheckpointError) as e:
        safe_torch_load(str(path))
    assert str(path) in str(e.value) and "corrupted or truncated" in str(e.value) and "\n" not in str(e.value)


def test_real_checkpoint_verifies_weights_only(base_run):
    for step in range(1, BASE_STEPS + 1):
        verify_checkpoint(str(ckpt_dir(base_run.run_dir, step)))


def test_resume_refuses_a_planted_malicious_rank_file(base_run, runs_root):
    run = copy_run(base_run.run_dir, runs_root / "evil")
    canary = runs_root / "pwned_resume"
    plant_malicious(ckpt_dir(run, BASE_STEPS) / "rank_00000.pt", canary)
    r = run_training(run, resume_overrides(base_run, BASE_STEPS + 1), launcher=False)
    assert r.returncode == 3, r.tail()
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "rank_00000.pt" in err[0] and "pickled code" in err[0]
    assert not canary.exists()


@pytest.fixture(scope="module")
def truncated_run(base_run, runs_root):
    run = copy_run(base_run.run_dir, runs_root / "truncated")
    victim = ckpt_dir(run, BASE_STEPS) / "mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    return run, victim


def test_truncated_checkpoint_is_a_one_line_error_naming_the_file(base_run, truncated_run):
    run, victim = truncated_run
    r = run_training(run, resume_overrides(base_run, BASE_STEPS + 1), launcher=False)
    assert r.returncode == 3, r.tail()
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and str(victim) in err[0] and "corrupted or truncated" in err[0]


def test_fallback_resumes_the_previous_checkpoint_and_reproduces_the_losses(base_run, truncated_run):
    run, _ = truncated_run
    r = run_training(run, [*resume_overrides(base_run, BASE_STEPS), "checkpoint.fallback=true"], launcher=False)
    assert r.returncode == 0, r.tail()
    assert f"resumed from {ckpt_dir(run, BASE_STEPS - 1)}" in r.stdout
    assert r.losses() == base_run.losses()  # step 4 recomputed from checkpoint 3: bitwise the same


def test_wandb_key_never_written_to_run_dir_or_logs(base_run):
    hits = [str(p) for p in base_run.run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert hits == []
    assert SECRET not in base_run.stdout and SECRET not in base_run.stderr


def _export(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training.export", str(src), str(out)],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_export_of_a_truncated_checkpoint_is_one_line_and_writes_nothing(base_run, runs_root):
    run = copy_run(base_run.run_dir, runs_root / "export_truncated_src")  # (the fallback test repairs truncated_run)
    victim = ckpt_dir(run, BASE_STEPS) / "mp_rank_00_model_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    r = _export(run, runs_root / "export_truncated")
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert str(victim) in err[0] and "corrupted or truncated" in err[0]
    assert not (runs_root / "export_truncated").exists()


def test_export_of_a_checkpoint_whose_config_does_not_match_its_weights_is_one_line(base_run, runs_root):
    run = copy_run(base_run.run_dir, runs_root / "mismatched")
    cfg_path = ckpt_dir(run, BASE_STEPS) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["hidden_size"] = cfg["hidden_size"] // 2
    cfg_path.write_text(json.dumps(cfg))
    r = _export(run, runs_root / "export_mismatched")
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "is inconsistent" in err[0] and "config.json" in err[0]
    assert not (runs_root / "export_mismatched").exists()
