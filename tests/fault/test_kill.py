"""Faults 1 and 2: kill -9 of a rank or of the whole launcher, and kills inside a checkpoint write, on a 2-rank
EP=2 CPU job (ZeRO-2). `checkpoint.resume=auto` must continue from the newest COMPLETE checkpoint and reproduce the
uninterrupted job's losses bitwise; a partial checkpoint is never resumed and is replaced/pruned afterwards.

CI runs one kill mid-checkpoint (tests/distributed/test_resume.py covers a plain exit after a step); the matrix
(K3_FAULT_FULL=1) kills at 5 more steps, both
ranks, the launcher's process group at 2 points and every checkpoint phase (kill -9 of the launcher process alone:
test_processes.py).
"""

from __future__ import annotations

import pytest

from tests.distributed.conftest import EP2_JOB as JOB
from tests.distributed.conftest import EP2_STEPS as STEPS
from tests.fault.conftest import ckpt_dir, partial_tags, record, run_and_kill_launcher, run_training
from training.checkpoint import SAVE_PHASES as CKPT_PHASES

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference(ep2_ref):
    """The uninterrupted job: the session's EP=2 run (tests/conftest.py; test_expert_parallel_train.py's too)."""
    return ep2_ref


def _resume_and_check(run_dir, reference, fault: str, killed_rc: int):
    resumed = run_training(run_dir, JOB, nproc=2)
    same = resumed.returncode == 0 and resumed.losses() == reference.losses()
    record(fault, survived=resumed.returncode == 0, data_lost=not same, detail=f"killed rc={killed_rc}")
    assert killed_rc != 0
    assert resumed.returncode == 0, resumed.tail()
    assert resumed.losses() == reference.losses()  # every step, exact float equality
    assert partial_tags(run_dir) == []  # no partial checkpoint survives the resumed job
    assert (ckpt_dir(run_dir, STEPS) / "COMPLETE").is_file()
    return resumed


def _kill_rank(runs_root, reference, step: int, rank: int):
    run_dir = runs_root / f"kill_s{step}_r{rank}"
    killed = run_training(run_dir, JOB, nproc=2, env={"K3_FAULT_KILL_AT_STEP": str(step), "K3_FAULT_RANK": str(rank)})
    assert max(r["step"] for r in killed.metrics) == step  # it really died at that step
    _resume_and_check(run_dir, reference, "kill -9 one rank", killed.returncode)


def _kill_in_checkpoint(runs_root, reference, phase: str, step: int = 4):
    run_dir = runs_root / f"kill_ckpt_{phase}"
    killed = run_training(
        run_dir,
        JOB,
        nproc=2,
        env={"K3_FAULT_KILL_AT_STEP": str(step), "K3_FAULT_KILL_IN_CKPT_PHASE": phase, "K3_FAULT_RANK": "0"},
    )
    from training.checkpoint import find_latest

    latest = find_latest(str(run_dir / "checkpoints"))
    committed = phase == "before_prune"  # `latest` names step 4 (before that, step 4 is an orphan: never resumed)
    assert latest == str(ckpt_dir(run_dir, step if committed else step - 2))
    assert (ckpt_dir(run_dir, step - 2) / "COMPLETE").is_file()  # the previous checkpoint is intact
    _resume_and_check(run_dir, reference, "kill -9 during checkpoint write", killed.returncode)


def test_kill_mid_checkpoint_keeps_previous_and_resumes_bitwise(runs_root, reference):
    _kill_in_checkpoint(runs_root, reference, "after_rank_file")


@pytest.mark.fault_matrix
@pytest.mark.parametrize("step,rank", [(1, 0), (3, 1), (4, 0), (5, 1), (7, 0)])
def test_kill_rank_at_step_matrix(runs_root, reference, step, rank):
    _kill_rank(runs_root, reference, step, rank)


@pytest.mark.fault_matrix
@pytest.mark.parametrize("phase", [p for p in CKPT_PHASES if p != "after_rank_file"])
def test_kill_in_checkpoint_phase_matrix(runs_root, reference, phase):
    _kill_in_checkpoint(runs_root, reference, phase)


@pytest.mark.fault_matrix
@pytest.mark.parametrize("at_step", [3, 6])
def test_kill_launcher_process_group_resumes_bitwise(runs_root, reference, at_step):
    run_dir = runs_root / f"kill_launcher_{at_step}"
    killed = run_and_kill_launcher(run_dir, JOB, at_step)
    _resume_and_check(run_dir, reference, "kill -9 launcher (process group)", killed.returncode or -9)


@pytest.mark.fault_matrix
def test_resume_with_world_size_2_to_1_continues_the_same_global_batches(runs_root, reference):
    import shutil

    run_dir = runs_root / "ws2to1"
    shutil.copytree(reference.run_dir, run_dir)
    (run_dir / "metrics.jsonl").unlink()
    one = [o for o in JOB if not o.startswith(("parallel=", "train.grad_accum"))] + [
        "train.grad_accum=2",
        f"train.steps={STEPS + 2}",
        "checkpoint.allow_changes=[train.steps]",
    ]
    r = run_training(run_dir, one, nproc=1, launcher=False)
    ok = r.returncode == 0 and [m["step"] for m in r.metrics] == [STEPS + 1, STEPS + 2]
    record("resume with world size 2 -> 1", survived=ok, data_lost=not ok)
    assert r.returncode == 0, r.tail()
    assert f"resumed from {ckpt_dir(run_dir, STEPS)}" in r.stdout
    assert [m["step"] for m in r.metrics] == [STEPS + 1, STEPS + 2]
    assert all(m["tokens"] == reference.metrics[0]["tokens"] for m in r.metrics)  # same global batch size
