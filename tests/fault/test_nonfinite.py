"""Fault 4: a NaN/Inf loss or gradient skips the step without touching weights, optimizer state or LR schedule;
skipped steps are counted in metrics.jsonl; N consecutive bad steps stop the run with a message and a checkpoint.

Real 1-rank jobs (python -m training.train) with the test hooks of tests/fault/injector.py, checkpoints every step.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.fault.conftest import TINY, bitwise_diff, ckpt_dir, load_states, run_training, tensors_of

BASE = [*TINY, "train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=10"]
# name -> (fault env, extra overrides) of each job
JOBS = {
    "nan_zero2": ({"K3_FAULT_NAN_AT_STEP": "2"}, []),
    "infgrad_zero0": ({"K3_FAULT_INF_GRAD_AT_STEP": "3"}, ["deepspeed=zero0"]),
    "nan_stop": ({"K3_FAULT_NAN_AT_STEP": "2,3,4"}, ["train.max_bad_steps=2"]),
}


@pytest.fixture(scope="module")
def jobs(runs_root) -> dict:
    """The three jobs at once (independent; concurrent 1-rank jobs overlap their start-up): name -> RunResult."""
    with ThreadPoolExecutor(len(JOBS)) as pool:
        futs = {
            name: pool.submit(run_training, runs_root / name, [*BASE, *extra], launcher=False, env=env)
            for name, (env, extra) in JOBS.items()
        }
        return {name: f.result() for name, f in futs.items()}


@pytest.fixture(scope="module")
def nan_run(jobs):
    return jobs["nan_zero2"]


@pytest.fixture(scope="module")
def inf_grad_zero0_run(jobs):
    return jobs["infgrad_zero0"]


def _assert_step_untouched(run_dir, before: int, after: int):
    m0, o0 = load_states(ckpt_dir(run_dir, before))
    m1, o1 = load_states(ckpt_dir(run_dir, after))
    assert bitwise_diff(tensors_of(m0["module"]), tensors_of(m1["module"])) == []
    assert bitwise_diff(tensors_of(o0), tensors_of(o1)) == []
    assert m0["lr_scheduler"] == m1["lr_scheduler"]  # the LR schedule did not advance either


def test_nan_loss_step_leaves_weights_and_optimizer_bitwise_unchanged_zero2(nan_run):
    assert nan_run.returncode == 0, nan_run.tail()
    _assert_step_untouched(nan_run.run_dir, 1, 2)


def test_step_after_a_skipped_step_trains_again(nan_run):
    m2, _ = load_states(ckpt_dir(nan_run.run_dir, 2))
    m3, _ = load_states(ckpt_dir(nan_run.run_dir, 3))
    assert bitwise_diff(tensors_of(m2["module"]), tensors_of(m3["module"]))  # step 3 changed the weights


def test_skipped_steps_are_counted_in_metrics(nan_run):
    by_step = {r["step"]: r for r in nan_run.metrics}
    assert [by_step[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert by_step[2]["loss"] is None  # NaN is written as null (strict JSON)
    assert all(by_step[s]["loss"] is not None for s in (1, 3, 4))


def test_inf_gradient_with_finite_loss_is_skipped_under_zero0(inf_grad_zero0_run):
    r = inf_grad_zero0_run
    assert r.returncode == 0, r.tail()
    by_step = {x["step"]: x for x in r.metrics}
    assert by_step[3]["loss"] is not None and by_step[3]["skipped_steps"] == 1  # loss finite, grads not
    _assert_step_untouched(r.run_dir, 2, 3)


def test_consecutive_bad_steps_stop_with_message_and_checkpoint(jobs):
    r = jobs["nan_stop"]
    assert r.returncode == 3, r.tail()
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert line and "2 consecutive non-finite steps" in line[0] and "train.max_bad_steps=2" in line[0]
    assert (ckpt_dir(r.run_dir, 3) / "COMPLETE").is_file() and not ckpt_dir(r.run_dir, 4).exists()
    _assert_step_untouched(r.run_dir, 1, 3)  # the stop checkpoint holds the last good step's weights
