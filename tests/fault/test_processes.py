"""Issue 17: one job per run dir, and no rank outlives its launcher.

A run dir is locked (`<run_dir>/.lock`, fcntl.flock, rank 0) for a job's life: a second job stops with one line
naming the holder and writes nothing. kill -9 of the `deepspeed` runner alone (its child `deepspeed.launcher.launch`
is the ranks' parent) takes the ranks down within seconds (training/watchdog.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.distributed.conftest import REPO, job_env
from tests.fault.conftest import (
    TINY,
    one_error_line,
    record,
    run_and_kill_launcher,
    run_training,
    snapshot,
    wait_group_gone,
)

GONE_WITHIN_S = 10.0


def test_a_second_job_on_a_locked_run_dir_stops_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from training.rundir import lock_run_dir; "
            f"lock_run_dir({str(run)!r}); print('locked', flush=True); sys.stdin.read()",
        ],
        cwd=REPO,
        env=job_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run)
        r = run_training(run, [*TINY, "train.steps=1"], launcher=False)
        line = one_error_line(r)
        record("second job on a locked run dir", survived=r.returncode == 2, data_lost=snapshot(run) != before)
        assert f"run_dir {run} is in use by another job (pid {holder.pid} on " in line
        assert snapshot(run) == before  # the .lock file only
    finally:
        holder.communicate("")


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.fault_matrix)])
def test_killing_the_launcher_process_takes_its_ranks_down_within_seconds(tmp_path, nproc):
    job = [*TINY, "train.steps=500", "checkpoint.every=1"]
    killed = run_and_kill_launcher(tmp_path / "run", job, at_step=1, whole_group=False, nproc=nproc)
    gone = wait_group_gone(killed.pgid, timeout=30)
    after = time.time() - killed.killed_at
    record(
        f"kill -9 launcher pid only ({nproc} rank(s): none outlives it)",
        survived=gone and after < GONE_WITHIN_S,
        data_lost=False,
        detail=f"ranks gone {after:.1f} s after the kill",
    )
    assert gone and after < GONE_WITHIN_S, f"ranks still alive {after:.1f} s after the launcher was killed"
    assert max(m["step"] for m in killed.metrics) < 500
    assert "the deepspeed launcher" in killed.stderr
