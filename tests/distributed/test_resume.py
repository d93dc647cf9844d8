"""A job killed after step k and resumed with checkpoint.resume=auto reproduces the uninterrupted losses bitwise."""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import REF, REF_STEPS, read_metrics, run_training

pytestmark = pytest.mark.distributed
KILL_AFTER = 4  # the last checkpoint before the kill is step 3, so step 4 is computed twice


@pytest.fixture(scope="module")
def killed_then_resumed(runs_root):
    run_dir = runs_root / "resume"
    killed = run_training(run_dir, REF, nproc=2, env={"K3_FAULT_KILL_AT_STEP": str(KILL_AFTER)})
    resumed = run_training(run_dir, [*REF, "checkpoint.resume=auto"], nproc=2)
    return killed, resumed


def test_killed_run_died_after_step_k_with_a_complete_checkpoint(killed_then_resumed):
    killed, _ = killed_then_resumed
    assert killed.returncode != 0
    steps = [r["step"] for r in killed.metrics]
    assert steps == list(range(1, KILL_AFTER + 1))
    assert (killed.run_dir / "checkpoints" / "step_00000003" / "COMPLETE").is_file()


def test_resume_reproduces_uninterrupted_losses_bitwise(killed_then_resumed, ref_run):
    _, resumed = killed_then_resumed
    assert resumed.returncode == 0, resumed.tail()
    assert "resumed from" in resumed.stdout
    assert resumed.losses() == ref_run.losses()  # exact float equality, every step


def test_recomputed_step_after_resume_is_identical_and_appended(killed_then_resumed):
    _, resumed = killed_then_resumed
    records = read_metrics(resumed.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4, 5, 6]
    first, again = [r for r in records if r["step"] == 4]
    assert first["loss"] == again["loss"] and first["grad_norm"] == again["grad_norm"]


def test_resumed_run_continues_the_same_wandb_run(killed_then_resumed):
    _, resumed = killed_then_resumed
    state = json.loads((resumed.run_dir / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["wandb_run_id"] and (resumed.run_dir / "wandb_run_id").read_text().strip() == state["wandb_run_id"]
    dirs = list((resumed.run_dir / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2 and all(d.name.endswith(state["wandb_run_id"]) for d in dirs)  # two processes, one run


def test_resumed_wandb_segment_continues_the_step_counter(killed_then_resumed, tmp_path):
    from training.metrics.sinks import read_wandb_offline_history

    _, resumed = killed_then_resumed
    newest = sorted((resumed.run_dir / "wandb").glob("offline-run-*"))[-1]
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / newest.name).symlink_to(newest)
    rows = [r for r in read_wandb_offline_history(tmp_path) if "loss" in r]
    assert [r["_step"] for r in rows] == [r["step"] for r in rows] == [4, 5, 6]


def test_resumed_summary_counts_only_this_sessions_tokens(killed_then_resumed):
    _, resumed = killed_then_resumed
    summary = json.loads((resumed.run_dir / "summary.json").read_text())
    per_step = summary["tokens_seen"] // REF_STEPS
    assert summary["session_tokens"] == (REF_STEPS - 3) * per_step  # resumed at step 3
    assert summary["tokens_per_s"] == pytest.approx(summary["session_tokens"] / summary["elapsed_s"], rel=1e-6)
