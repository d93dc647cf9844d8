"""The two-node cluster (tests/multinode/cluster.py) for this directory's tests, once per session; a way to run
`launch/multinode.sh` on its first node; the uninterrupted two-node job the other jobs are compared with. Skipped
with one line where the machine cannot build the cluster (not root, no `ip netns`, sshd/pdsh not installed:
`.ci/run` installs them)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from tests.distributed.conftest import REPO, TINY, RunResult, job_env, must_succeed, read_metrics
from tests.multinode.cluster import Cluster, bring_up, unavailable

# 2 ranks (one per node, or two on one node), ZeRO-3, EP=2: global batch 4 rows, 6 steps, checkpoints every 3
STEPS, EVERY = 6, 3
JOB = [
    *TINY,
    f"train.steps={STEPS}",
    f"checkpoint.every={EVERY}",
    "train.micro_batch_size=2",
    "train.grad_accum=1",
    "deepspeed=zero3",
    "parallel.ep_size=2",
]


@pytest.fixture(scope="session")
def runs_root():
    """Own temp dir (not pytest's tmp_path: concurrent pytest sessions prune each other's old base dirs)."""
    root = Path(tempfile.mkdtemp(prefix="k3-multinode-runs-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster():
    why = unavailable()
    if why:
        pytest.skip(why)
    c = bring_up()
    yield c
    c.stop()


@dataclass
class NodeRun(RunResult):
    wall_s: float = 0.0
    started: float = 0.0  # epoch seconds when launch/multinode.sh was started

    def spawn_s(self, host: str) -> float | None:
        """Seconds from the launch to DeepSpeed's per-node launcher on `host` starting its rank(s) (its log line)."""
        pat = re.compile(rf"^{re.escape(host)}: \[(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\].*process \d+ spawned")
        for line in (self.stdout + self.stderr).splitlines():
            m = pat.match(line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                return t - self.started
        return None


def start_multinode(
    cluster: Cluster,
    run_dir: Path,
    overrides: list[str],
    ranks_per_node: int = 1,
    env: dict[str, str] | None = None,
    hosts: int | None = None,
) -> subprocess.Popen:
    """`HOSTFILE=... GPUS_PER_NODE=n launch/multinode.sh run_dir=... <overrides>` typed on the first node (the
    hostfile lists the first `hosts` nodes, all by default). K3_FAULT_* in `env` plugs the test-only injector."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    hostfile = run_dir.parent / f"hostfile-{run_dir.name}-{hosts}"
    hostfile.write_text("".join(f"{n.addr} slots={ranks_per_node}\n" for n in cluster.nodes[:hosts]))
    extra = {**cluster.env(), "HOSTFILE": str(hostfile), "GPUS_PER_NODE": str(ranks_per_node), "OMP_NUM_THREADS": "1"}
    args = [f"run_dir={run_dir}", *overrides]
    if any(k.startswith("K3_FAULT_") for k in (env or {})):
        args.append("callbacks=[tests.fault.injector.FaultInjector]")
    cmd = cluster.netns(cluster.nodes[0], ["launch/multinode.sh", *args])
    return subprocess.Popen(
        cmd, cwd=REPO, env=job_env({**extra, **(env or {})}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def multinode(cluster: Cluster, run_dir: Path, overrides: list[str], ranks_per_node: int = 1, **kw) -> NodeRun:
    """`start_multinode`, waited for."""
    t0, started = time.monotonic(), time.time()
    p = start_multinode(cluster, run_dir, overrides, ranks_per_node, **kw)
    out, err = p.communicate(timeout=600)
    return NodeRun(p.returncode, out, err, run_dir, read_metrics(run_dir), time.monotonic() - t0, started)


@pytest.fixture(scope="session")
def two_nodes(cluster, runs_root) -> NodeRun:
    """The uninterrupted job on 2 nodes x 1 rank."""
    run = must_succeed(multinode(cluster, runs_root / "multinode" / "two_nodes", JOB))
    first = next((r["time_to_first_step_s"] for r in run.metrics if "time_to_first_step_s" in r), None)
    spawn = {n.addr: run.spawn_s(n.addr) for n in cluster.nodes}
    print(f"two nodes: wall {run.wall_s:.1f} s, rank started per node {spawn} s, rank 0 first step {first} s")
    return run
