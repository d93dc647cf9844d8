"""Issue 17: sweep jobs get their own run directory keyed by their overrides (`runs/sweep/<name>/<key>`, or a
subdirectory per job of a given `run_dir=`), so a job never resumes another job's checkpoint and a re-run with new
values trains them in new directories; every job of a sweep logs to one W&B group. Real `launch/sweep.sh` multiruns,
1 rank per job, W&B offline."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.distributed.conftest import REPO, job_env
from tests.fault.conftest import TINY_WANDB, read_metrics, record
from training.metrics.sinks import read_wandb_offline_run
from training.train import sweep_group, sweep_job_dir

pytestmark = pytest.mark.distributed
JOB = [*TINY_WANDB, "train.steps=2"]


def _sweep(root, lrs: str) -> subprocess.CompletedProcess:
    cmd = [
        str(REPO / "launch" / "sweep.sh"),
        *JOB,
        f"optim.lr={lrs}",
        f"run_dir={root}",
        f"hydra.sweep.dir={root}/multirun",
    ]
    return subprocess.run(cmd, cwd=REPO, env=job_env({"NUM_RANKS": "1"}), capture_output=True, text=True, timeout=900)


def _job_dir(root: Path, lr: str) -> Path:
    """The job's run dir (Hydra's sweeper hands the job `optim.lr=0.01` for `1e-2`)."""
    lr = str(float(lr))
    return Path(sweep_job_dir("tiny_ci", [*JOB, f"optim.lr={lr}", f"run_dir={root}"], str(root)))


def test_sweep_job_dir_is_keyed_by_the_sorted_sanitised_overrides():
    a = sweep_job_dir("n", ["train.steps=3", "optim.lr=1e-2"], None)
    assert a == "runs/sweep/n/optim.lr-1e-2__train.steps-3"
    assert sweep_job_dir("n", ["optim.lr=1e-2", "train.steps=3"], None) == a  # order-independent
    assert sweep_job_dir("n", ["optim.lr=3e-2", "train.steps=3"], None) != a
    assert sweep_job_dir("n", ["optim.lr=1e-2", "run_dir=/x"], "/x") == "/x/optim.lr-1e-2"
    long = sweep_job_dir("n", [f"data.sources=[{{type: jsonl, path: /d/{'x' * 200}.jsonl}}]"], None)
    assert " " not in long and "/d/" not in long and len(long.rsplit("/", 1)[1]) <= 120


@pytest.fixture(scope="module")
def first_sweep(runs_root):
    """A sweep over two lrs into one given run_dir."""
    root = runs_root / "sweep"
    first = _sweep(root, "1e-2,3e-2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    return root


def test_sweep_jobs_train_in_their_own_run_dirs(first_sweep):
    root = first_sweep
    steps = {lr: [m["step"] for m in read_metrics(_job_dir(root, lr))] for lr in ("1e-2", "3e-2")}
    record(
        "sweep jobs with run_dir= (own dirs)",
        survived=steps == {"1e-2": [1, 2], "3e-2": [1, 2]},
        data_lost=steps != {"1e-2": [1, 2], "3e-2": [1, 2]},
    )
    assert steps == {"1e-2": [1, 2], "3e-2": [1, 2]}  # each job trained from step 1, none resumed another's


def test_sweep_jobs_share_one_wandb_group(first_sweep):
    """W&B's group (in each job's offline run file, what `wandb sync` uploads) is the sweep's folder: the same for
    every job of the sweep, set by the sweep itself (`logging.group`, not given on the command line)."""
    root = first_sweep
    runs = [read_wandb_offline_run(_job_dir(root, lr)) for lr in ("1e-2", "3e-2")]
    assert [r["group"] for r in runs] == [str(root)] * 2 and runs[0]["id"] != runs[1]["id"]
    assert sweep_group("runs/sweep/smoke/optim.lr-0.001") == "runs/sweep/smoke"
    assert sweep_group(f"/{'x' * 300}/k") == "x" * 128  # W&B's limit


@pytest.mark.fault_matrix
def test_sweep_rerun_with_a_new_value_trains_it_in_a_new_dir_and_continues_the_old_one(first_sweep):
    root = first_sweep
    before = (_job_dir(root, "3e-2") / "metrics.jsonl").read_bytes()
    again = _sweep(root, "3e-2,5e-2")
    ok = again.returncode == 0 and [m["step"] for m in read_metrics(_job_dir(root, "5e-2"))] == [1, 2]
    record("sweep re-run with new values", survived=again.returncode == 0, data_lost=not ok)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [m["step"] for m in read_metrics(_job_dir(root, "5e-2"))] == [1, 2]
    assert f"resumed from {_job_dir(root, '3e-2')}/checkpoints/step_00000002 at step 2" in again.stdout
    assert (_job_dir(root, "3e-2") / "metrics.jsonl").read_bytes() == before  # the same job: at its end already
