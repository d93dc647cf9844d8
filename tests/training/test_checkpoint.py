"""Checkpoint bookkeeping: only COMPLETE checkpoints count, `latest` is the authority (newer ones are orphans),
keep-last-N never deletes the checkpoint `latest` names, corrupt ones are moved aside, RNG round trip, and the run
identity that decides whether a checkpoint belongs to the run being started."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from data.files import atomic_write as _atomic_write
from training.checkpoint import (
    RunMismatch,
    complete_tags,
    find_latest,
    orphans,
    pick_resume,
    resolve_checkpoint,
    rng_state,
    run_identity,
    set_rng_state,
    tag_for,
)
from training.checkpoint.identity import check_allow_changes, plan_resume
from training.checkpoint.store import COMPLETE, _prune
from training.config import compose, validate


def make_tag(root, step, complete=True):
    d = root / tag_for(step)
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        (d / COMPLETE).write_text("")
    return d


def test_incomplete_newer_checkpoint_is_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    good = make_tag(root, 10)
    make_tag(root, 20, complete=False)  # a crash mid-write
    assert find_latest(str(root)) == str(good)


def test_latest_marker_pointing_at_incomplete_dir_falls_back_to_the_newest_older_complete(tmp_path):
    root = tmp_path / "checkpoints"
    make_tag(root, 10)
    good = make_tag(root, 20)
    make_tag(root, 30, complete=False)
    (root / "latest").write_text(tag_for(30))
    assert find_latest(str(root)) == str(good)


def test_complete_checkpoint_newer_than_latest_is_an_orphan_never_picked(tmp_path):
    root = tmp_path / "checkpoints"
    a = make_tag(root, 10)
    make_tag(root, 20)
    (root / "latest").write_text(tag_for(10))  # e.g. a crash between COMPLETE of step 20 and the marker update
    assert find_latest(str(root)) == str(a)
    assert orphans(str(root)) == [tag_for(20)]


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert find_latest(str(tmp_path / "nothing")) is None


def test_resolve_accepts_run_dir_checkpoints_dir_and_tag_dir(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    t = make_tag(root, 5)
    for p in (tmp_path / "run", root, t):
        assert resolve_checkpoint(str(p)) == str(t)


def test_prune_keeps_last_n_complete_and_drops_stale_partials(tmp_path):
    root = tmp_path / "c"
    for s in (1, 2, 3, 4):
        make_tag(root, s)
    make_tag(root, 0, complete=False)
    _prune(str(root), keep_last=2, keep=tag_for(4))
    assert complete_tags(str(root)) == [tag_for(3), tag_for(4)]
    assert not (root / tag_for(0)).exists()


def test_prune_keeps_the_checkpoint_latest_names_and_never_counts_newer_orphans(tmp_path):
    root = tmp_path / "c"
    for s in (1, 2, 3, 4, 9):  # 9: an orphan newer than the checkpoint just committed (4)
        make_tag(root, s)
    _prune(str(root), keep_last=2, keep=tag_for(4))
    assert complete_tags(str(root)) == [tag_for(3), tag_for(4), tag_for(9)]


def make_good_tag(root, step):
    d = root / tag_for(step)
    d.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(2)}}, d / "mp_rank_00_model_states.pt")
    (d / "trainer_state.json").write_text(json.dumps({"step": step}))
    (d / COMPLETE).write_text("")
    return d


def test_fallback_moves_a_corrupt_checkpoint_aside_and_points_latest_at_the_pick(tmp_path):
    root = tmp_path / "checkpoints"
    good = make_good_tag(root, 3)
    make_tag(root, 4)  # complete but its model states are garbage
    (root / "latest").write_text(tag_for(4))
    assert pick_resume(find_latest(str(root)), fallback=True, is_main=True, settle=True) == str(good)
    assert (root / f"{tag_for(4)}.corrupt").is_dir() and not (root / tag_for(4)).exists()
    assert (root / "latest").read_text() == tag_for(3)
    assert complete_tags(str(root)) == [tag_for(3)]  # keep_last can no longer count the corrupt one


def test_atomic_write_leaves_no_tmp_files(tmp_path):
    p = tmp_path / "latest"
    _atomic_write(str(p), "step_00000001")
    _atomic_write(str(p), "step_00000002")
    assert p.read_text() == "step_00000002"
    assert [f.name for f in tmp_path.iterdir()] == ["latest"]


def test_rng_state_round_trip_reproduces_all_three_generators():
    st = rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(st)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


# --- run identity ---------------------------------------------------------------------------------------------
TINY = ["experiment=tiny_ci"]


def _identity(overrides: list[str], world: int = 1) -> dict:
    cfg = compose([*TINY, *overrides])
    return run_identity(cfg, validate(cfg, world), world)


def test_same_global_batch_at_another_world_size_is_the_same_run():
    assert _identity(["train.grad_accum=2"], world=1) == _identity(["train.grad_accum=1"], world=2)


def test_identity_differs_in_exactly_the_changed_key():
    a, b = _identity([]), _identity(["train.seed=7"])
    assert [k for k in a if a[k] != b[k]] == ["train.seed"]


def _refusal(old: dict, new: dict, allow: list[str]) -> str:
    with pytest.raises(RunMismatch) as e:
        plan_resume(new, {"step": 4, "run_identity": old}, "/r/checkpoints/step_00000004", allow, "/r")
    assert "\n" not in str(e.value)
    return str(e.value)


def test_mismatch_names_each_differing_key_old_to_new_and_the_allowable_choice():
    old, new = _identity([]), _identity(["optim.lr=0.01", "train.steps=9"])
    msg = _refusal(old, new, [])
    assert "optim.lr 0.003 -> 0.01" in msg and "train.steps 6 -> 9" in msg
    assert "new run_dir=" in msg and "checkpoint.allow_changes=[optim.lr,train.steps]" in msg


def test_allowing_one_change_still_refuses_another():
    old, new = _identity([]), _identity(["optim.lr=0.01", "train.seed=1"])
    msg = _refusal(old, new, ["optim.lr"])
    assert "train.seed 0 -> 1" in msg and "optim.lr" not in msg


def test_allow_data_admits_any_data_key_and_plans_a_fresh_data_position():
    old, new = _identity([]), _identity(["data.shuffle_buffer=7"])
    plan = plan_resume(new, {"step": 4, "run_identity": old}, "/r/checkpoints/step_00000004", ["data"], "/r")
    assert plan.changed == ["data.shuffle_buffer"] and plan.fresh_data and not plan.new_lr


def test_more_steps_keep_the_stored_schedule_horizon():
    old, new = _identity([]), _identity(["train.steps=20"])
    state = {"step": 6, "run_identity": old, "schedule_horizon": 6}
    assert plan_resume(new, state, "/r/checkpoints/step_00000006", ["train.steps"], "/r").horizon == 6


def test_unknown_allow_changes_name_is_refused_with_the_choices():
    with pytest.raises(RunMismatch, match=r"'model' is not a change .*train.steps,data,optim.lr"):
        check_allow_changes(["model"])
