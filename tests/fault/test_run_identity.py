"""Issue 17: a resume never mixes two runs. A checkpoint records the run identity (training/checkpoint/identity.py);
`checkpoint.resume=auto` refuses, before anything is written, a job that differs from it beyond
`checkpoint.allow_changes`, and `resume=none` refuses a run dir that holds checkpoints unless `start_over=true`
archives the old run. Retention never deletes the last good checkpoint: a corrupt one found at resume is moved
aside. All 1-rank jobs on copies of the shared `base_run` (4 steps, a checkpoint every step), run concurrently."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.fault.conftest import (
    BASE_STEPS,
    ckpt_dir,
    copy_run,
    one_error_line,
    record,
    resume_overrides,
    run_training,
    snapshot,
)
from training.checkpoint import complete_tags

BASE_LR = 3e-3  # tiny_ci
NEW_LR = 1e-2
MIN_LR_RATIO = 0.1  # schedule=cosine


def _jobs(base_run) -> dict[str, list[str]]:
    """name -> overrides of each trial (run on its own copy of base_run)."""
    base = resume_overrides(base_run, BASE_STEPS)
    return {
        "lr_refused": [*base, f"optim.lr={NEW_LR}"],
        "arch": [*base, "model.hidden_size=32"],
        "none": [*base, "checkpoint.resume=none"],
        "lr_allowed": [
            *resume_overrides(base_run, BASE_STEPS, allow=("optim.lr",)),
            f"optim.lr={NEW_LR}",
            "checkpoint.resume=STEP2",
        ],
        "steps": resume_overrides(base_run, BASE_STEPS + 2),  # (allows train.steps)
        "start_over": [*resume_overrides(base_run, 1), "checkpoint.resume=none", "checkpoint.start_over=true"],
        # the newest checkpoint (4) is corrupt; the next save is at step 5 with keep_last=2
        "fallback": [
            *(
                o
                for o in resume_overrides(base_run, BASE_STEPS + 1)
                if not o.startswith(("checkpoint.every", "checkpoint.keep_last"))
            ),
            f"checkpoint.every={BASE_STEPS + 1}",
            "checkpoint.keep_last=2",
            "checkpoint.fallback=true",
        ],
    }


@pytest.fixture(scope="module")
def trials(base_run, runs_root) -> dict:
    """Every trial at once (they are independent; concurrent jobs overlap their start-up): name -> (result,
    snapshot of its run dir before the job)."""
    runs, before = {}, {}
    for name in _jobs(base_run):
        runs[name] = copy_run(base_run.run_dir, runs_root / f"id_{name}")
        if name == "fallback":
            victim = ckpt_dir(runs[name], BASE_STEPS) / "mp_rank_00_model_states.pt"
            victim.write_bytes(victim.read_bytes()[:1000])
        before[name] = snapshot(runs[name])
    with ThreadPoolExecutor(len(runs)) as pool:
        futs = {
            name: pool.submit(
                run_training, runs[name], [o.replace("STEP2", str(ckpt_dir(runs[name], 2))) for o in ov], launcher=False
            )
            for name, ov in _jobs(base_run).items()
        }
        return {name: (f.result(), before[name]) for name, f in futs.items()}


def _lrs(run_dir) -> dict[int, float]:
    return {
        int(m["step"]): m["lr"]
        for m in (json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip())
    }


def test_resume_with_a_changed_lr_refuses_naming_the_key_and_writes_nothing(trials):
    r, before = trials["lr_refused"]
    run = r.run_dir
    line = one_error_line(r)
    record("resume with changed lr (refused)", survived=r.returncode == 2, data_lost=snapshot(run) != before)
    assert f"optim.lr {BASE_LR} -> {NEW_LR}" in line and "checkpoint.allow_changes=[optim.lr]" in line
    assert "new run_dir=" in line
    assert snapshot(run) == before


def test_resume_after_an_architecture_change_is_one_line_not_a_traceback(trials):
    r, before = trials["arch"]
    run = r.run_dir
    line = one_error_line(r)
    record(
        "resume after an architecture change (refused)", survived=r.returncode == 2, data_lost=snapshot(run) != before
    )
    assert "model.hidden_size 64 -> 32" in line and "start_over" in line and "allow_changes" not in line
    assert snapshot(run) == before


def test_allowed_lr_change_scales_the_rest_of_the_same_schedule(base_run, trials):
    r, _ = trials["lr_allowed"]
    run = r.run_dir
    assert r.returncode == 0, r.tail()
    old, new = _lrs(base_run.run_dir), {m["step"]: m["lr"] for m in r.metrics if m["step"] > 2}
    assert sorted(new) == [3, 4]
    for step in (3, 4):  # the schedule's multiplier at that step, times the new peak lr
        assert new[step] == pytest.approx(old[step] / BASE_LR * NEW_LR, rel=1e-12)
    state = json.loads((ckpt_dir(run, 4) / "trainer_state.json").read_text())
    assert state["run_identity"]["optim.lr"] == NEW_LR  # the run is now the fine-tuned one


def test_more_steps_keep_the_original_schedule_and_then_its_final_value(base_run, trials):
    r, _ = trials["steps"]
    run = r.run_dir
    assert r.returncode == 0, r.tail()
    lrs = _lrs(run)
    ok = [lrs[s] for s in range(1, BASE_STEPS + 1)] == [_lrs(base_run.run_dir)[s] for s in range(1, BASE_STEPS + 1)]
    tail = [lrs[BASE_STEPS + 1], lrs[BASE_STEPS + 2]]
    record(
        "more steps with allow_changes (schedule horizon kept)",
        survived=r.returncode == 0,
        data_lost=not ok or tail != [BASE_LR * MIN_LR_RATIO] * 2,
    )
    assert ok  # the uninterrupted 4-step schedule, untouched
    assert tail == pytest.approx([BASE_LR * MIN_LR_RATIO] * 2, rel=1e-12)  # then its final value
    state = json.loads((ckpt_dir(run, BASE_STEPS + 2) / "trainer_state.json").read_text())
    assert state["schedule_horizon"] == BASE_STEPS and state["run_identity"]["train.steps"] == BASE_STEPS + 2


def test_resume_none_in_a_run_dir_with_checkpoints_refuses_and_writes_nothing(trials):
    r, before = trials["none"]
    run = r.run_dir
    line = one_error_line(r)
    record("resume=none in a used run dir (refused)", survived=r.returncode == 2, data_lost=snapshot(run) != before)
    assert "holds checkpoints of an earlier run" in line and "checkpoint.start_over=true" in line
    assert snapshot(run) == before


def test_start_over_archives_the_previous_run_and_starts_fresh(trials):
    r, before = trials["start_over"]
    run = r.run_dir
    old_files = {p for p in before if p != ".lock"}
    assert r.returncode == 0, r.tail()
    (archive,) = (run / "archive").iterdir()
    assert {str(p.relative_to(archive)) for p in archive.rglob("*") if p.is_file()} == old_files
    assert [m["step"] for m in r.metrics] == [1]  # metrics.jsonl holds the new run only
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000001"]
    record("start_over archives the old run", survived=True, data_lost=False)


def test_fallback_moves_the_corrupt_checkpoint_aside_and_keep_last_keeps_the_good_one(trials):
    r, _ = trials["fallback"]
    run, root = r.run_dir, r.run_dir / "checkpoints"
    assert r.returncode == 0, r.tail()
    kept = complete_tags(str(root))  # step_XXXXXXXX dirs with COMPLETE (a moved-aside one is not a tag)
    ok = kept == ["step_00000003", "step_00000005"] and (root / "step_00000004.corrupt").is_dir()
    record("corrupt newest + fallback + keep_last=2", survived=r.returncode == 0, data_lost=not ok)
    assert f"resumed from {ckpt_dir(run, BASE_STEPS - 1)}" in r.stdout
    assert any(ln.startswith("warning:") and "moved it aside" in ln for ln in r.stdout.splitlines())
    assert kept == ["step_00000003", "step_00000005"]  # the good checkpoint resumed from is kept, not the corrupt one
    assert (root / "step_00000004.corrupt" / "mp_rank_00_model_states.pt").is_file()
    assert (root / "latest").read_text() == "step_00000005"


@pytest.mark.fault_matrix
def test_allowed_data_change_continues_at_a_fresh_data_position(base_run, runs_root, tmp_path):
    run = copy_run(base_run.run_dir, runs_root / "id_data")
    corpus = tmp_path / "new.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"new document {i} " * 20}) + "\n" for i in range(50)))
    ov = [o for o in resume_overrides(base_run, BASE_STEPS + 2, allow=("data",)) if not o.startswith("data.sources")]
    r = run_training(run, [*ov, f"data.sources=[{{type: jsonl, path: {corpus}}}]"], launcher=False)
    new = [m for m in r.metrics if m["step"] > BASE_STEPS]
    record("resume on new data with allow_changes=[data]", survived=r.returncode == 0, data_lost=len(new) != 2)
    assert r.returncode == 0, r.tail()
    assert "the loader starts a fresh data position" in r.stdout
    assert [m["step"] for m in new] == [BASE_STEPS + 1, BASE_STEPS + 2]
    assert new[-1]["data/records_read"] < base_run.metrics[-1]["data/records_read"]  # counted from the new start
