"""The two-node cluster (tests/multinode/cluster.py) for this directory's tests, once per session, and a way to run
`launch/multinode.sh` on its first node. Skipped with one line where the machine cannot build it (not root, no
`ip netns`, sshd/pdsh not installed: `.ci/run` installs them)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed.conftest import REPO, RunResult, job_env, read_metrics, runs_root  # noqa: F401
from tests.multinode.cluster import Cluster, bring_up, unavailable

pytestmark = pytest.mark.distributed


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


def multinode(
    cluster: Cluster,
    run_dir: Path,
    overrides: list[str],
    ranks_per_node: int = 1,
    env: dict[str, str] | None = None,
    hostfile: Path | None = None,
    timeout: int = 600,
) -> NodeRun:
    """`HOSTFILE=... GPUS_PER_NODE=n launch/multinode.sh run_dir=... <overrides>` typed on the first node."""
    hostfile = hostfile or cluster.hostfile(run_dir.parent / f"hostfile-{run_dir.name}", ranks_per_node)
    extra = {**cluster.env(), "HOSTFILE": str(hostfile), "GPUS_PER_NODE": str(ranks_per_node), "OMP_NUM_THREADS": "1"}
    cmd = cluster.netns(cluster.nodes[0], ["launch/multinode.sh", f"run_dir={run_dir}", *overrides])
    t0 = time.monotonic()
    env = job_env({**extra, **(env or {})})
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return NodeRun(p.returncode, p.stdout, p.stderr, run_dir, read_metrics(run_dir), time.monotonic() - t0)
