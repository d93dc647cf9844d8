"""Checkpoint bookkeeping: only COMPLETE checkpoints count, `latest` is atomic, keep-last-N, RNG round trip."""
from __future__ import annotations

import random

import numpy as np
import torch

from data.files import atomic_write as _atomic_write
from training.checkpoint import complete_tags, find_latest, resolve_checkpoint, rng_state, set_rng_state, tag_for
from training.checkpoint.store import COMPLETE, _prune


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


def test_latest_marker_pointing_at_incomplete_dir_falls_back_to_newest_complete(tmp_path):
    root = tmp_path / "checkpoints"
    make_tag(root, 10)
    good = make_tag(root, 20)
    make_tag(root, 30, complete=False)
    (root / "latest").write_text(tag_for(30))
    assert find_latest(str(root)) == str(good)


def test_newer_complete_checkpoint_wins_over_a_lagging_marker(tmp_path):
    root = tmp_path / "checkpoints"
    make_tag(root, 10)
    b = make_tag(root, 20)
    (root / "latest").write_text(tag_for(10))  # a crash between COMPLETE of step 20 and the marker update
    assert find_latest(str(root)) == str(b)


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
