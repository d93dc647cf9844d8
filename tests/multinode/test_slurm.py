"""`sbatch launch/slurm.sbatch` on a real Slurm (slurmctld + one slurmd per namespace node, munge:
tests/multinode/slurm.py), both ways it starts the ranks, and a cancelled job resubmitted.

Jobs (tests/multinode/conftest.py JOB: 2 nodes x 1 rank, ZeRO-3 EP=2, 6 steps, checkpoints every 3), submitted on
node 1 with `sbatch --nodes=2 --gpus-per-node=0 --cpus-per-task=1 --output=...` (CPU nodes: the script's GPU and
CPU requests are overridden on the command line, as sbatch lets any #SBATCH line be):
  cancelled  K3_SLURM_LAUNCH=srun (srun starts DeepSpeed's launcher on each node, no inter-node ssh); paused after
             step 4 (test-only injector), `scancel`ed there
  resubmit   the default launch (one launcher on node 1, pdsh/ssh to both): continues from the step-3 checkpoint
             (checkpoint.resume=auto) to the end. Both variants in two jobs (a job less than one full job each).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import REPO, job_env, read_metrics
from tests.multinode.conftest import EVERY, JOB, STEPS
from tests.multinode.slurm import bring_up_slurm, unavailable

pytestmark = pytest.mark.distributed
CANCEL_AFTER = 4


@pytest.fixture(scope="module")
def slurm(cluster):
    why = unavailable()
    if why:
        pytest.skip(why)
    return bring_up_slurm(cluster)


def _env(cluster, slurm, extra: dict[str, str] | None = None) -> dict[str, str]:
    return job_env({**cluster.env(), **slurm.env(), "GPUS_PER_NODE": "1", "OMP_NUM_THREADS": "1", **(extra or {})})


def _on_node1(cluster, slurm, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = env or _env(cluster, slurm)
    return subprocess.run(cluster.netns(cluster.nodes[0], cmd), cwd=REPO, env=e, capture_output=True, text=True)


def sbatch(cluster, slurm, run_dir: Path, out: Path, env: dict[str, str], wait: bool) -> tuple[str, int]:
    """Submit launch/slurm.sbatch; with `wait`, until it ends (job id, its RunTime in seconds: Slurm's wall time)."""
    args = [f"run_dir={run_dir}", *JOB]
    if any(k.startswith("K3_FAULT_") for k in env):
        args.append("callbacks=[tests.fault.injector.FaultInjector]")
    cmd = ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={out}"]
    p = _on_node1(cluster, slurm, [*cmd, "launch/slurm.sbatch", *args], env)
    job = p.stdout.strip()
    assert p.returncode == 0 and job.isdigit(), (p.returncode, p.stdout, p.stderr)
    if not wait:
        return job, 0
    deadline = time.monotonic() + 600
    while (state := _state(cluster, slurm, job)) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        assert time.monotonic() < deadline, _tail(out)
        time.sleep(0.5)
    assert state == "COMPLETED", (state, _tail(out))
    info = _on_node1(cluster, slurm, ["scontrol", "show", "job", job]).stdout
    h, m, sec = next(w.split("=", 1)[1] for w in info.split() if w.startswith("RunTime=")).split("-")[-1].split(":")
    return job, int(h) * 3600 + int(m) * 60 + int(sec)


def _tail(path: Path) -> str:
    return path.read_text()[-4000:] if path.is_file() else "(no output file)"


def _state(cluster, slurm, job: str) -> str:
    out = _on_node1(cluster, slurm, ["scontrol", "show", "job", job]).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "?")


@pytest.fixture(scope="module")
def jobs(cluster, slurm, runs_root):
    root = runs_root / "slurm"
    root.mkdir(parents=True)
    out: dict = {}
    # cancelled mid-run: all ranks pause after step 4 (checkpoint 3 complete), scancel, then the same command again
    run_dir = root / "requeue"
    fault = {"K3_FAULT_PAUSE_AT_STEP": str(CANCEL_AFTER), "K3_FAULT_PAUSE_S": "120", "K3_SLURM_LAUNCH": "srun"}
    job, _ = sbatch(cluster, slurm, run_dir, root / "cancelled.out", _env(cluster, slurm, fault), wait=False)
    deadline = time.monotonic() + 300
    while CANCEL_AFTER not in {r.get("step") for r in read_metrics(run_dir) if "loss" in r}:
        assert time.monotonic() < deadline and _state(cluster, slurm, job) in ("PENDING", "RUNNING"), _tail(
            root / "cancelled.out"
        )
        time.sleep(0.2)
    _on_node1(cluster, slurm, ["scancel", job])
    while _state(cluster, slurm, job) not in ("CANCELLED", "FAILED", "COMPLETED"):
        assert time.monotonic() < deadline, _tail(root / "cancelled.out")
        time.sleep(0.2)
    out["cancelled_state"] = _state(cluster, slurm, job)
    out["cancelled_losses"] = _losses(run_dir)
    out["resubmit"], out["resubmit_s"] = sbatch(
        cluster, slurm, run_dir, root / "resubmit.out", _env(cluster, slurm), True
    )
    out["requeue_dir"] = run_dir
    out["root"] = root
    print(f"Slurm RunTime of the resubmitted job (ssh launch, steps 4-6 after a resume): {out['resubmit_s']} s")
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_sbatch_runs_to_completion_and_its_output_shows_both_nodes_training(jobs, cluster):
    text = (jobs["root"] / "resubmit.out").read_text()
    a, b = cluster.nodes
    assert f"on node[1-2], master {a.addr}, launch ssh" in text
    for node_rank, n in enumerate((a, b)):
        assert f"{n.addr}: " in text and f"node_rank={node_rank}" in text
    assert f"step {STEPS}/{STEPS} loss=" in text


def test_a_cancelled_job_resubmitted_continues_from_its_last_checkpoint_bitwise(jobs, two_nodes):
    assert jobs["cancelled_state"] == "CANCELLED"
    log = (jobs["root"] / "resubmit.out").read_text()
    assert f"resumed from {jobs['requeue_dir']}/checkpoints/step_{EVERY:08d} at step {EVERY}" in log
    got, ref = _losses(jobs["requeue_dir"]), two_nodes.losses()  # the last record of a step wins: the resubmit's
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref  # bitwise, every step (4 ran twice: the cancelled job's record is overwritten)


def test_the_srun_variant_trains_both_nodes_without_ssh(jobs, two_nodes):
    text = (jobs["root"] / "cancelled.out").read_text()
    assert "launch srun" in text
    assert "--no_ssh --node_rank 0" in text and "--no_ssh --node_rank 1" in text  # one launcher per node
    assert any(ln.startswith("1: ") and "dist_world_size=2" in ln for ln in text.splitlines())  # srun --label
    ref = two_nodes.losses()
    assert jobs["cancelled_losses"] == {s: ref[s] for s in range(1, CANCEL_AFTER + 1)}  # bitwise until cancelled
