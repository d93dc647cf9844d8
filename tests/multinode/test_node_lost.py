"""A node is lost mid-step: node 2's network goes (`ip link set down` on its interface: no FIN, no RST, the peer
just stops answering, as a node that loses power or its link does). Every rank exits within a bound that the
trainer's collective timeout (`parallel.timeout_s`, gloo here, NCCL on GPUs) and the launcher's ssh keepalives
set, nothing hangs, the last complete checkpoint is intact, and node 1 alone (world size 1, EP=1: DeepSpeed's
universal checkpoint) continues from it with the optimizer state.

The job is tests/multinode/conftest.py JOB (2 nodes x 1 rank, ZeRO-3 EP=2, checkpoints every 3 steps). The
test-only injector pauses node 2's rank right after step 4 (K3_FAULT_PAUSE_AT_STEP), so rank 0 is inside step 5's
first collective when the link goes down; the checkpoint of step 3 is the last complete one.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import read_metrics
from tests.multinode.cluster import IFNAME
from tests.multinode.conftest import EVERY, JOB, STEPS, multinode, start_multinode

pytestmark = pytest.mark.distributed
CUT_AFTER, TIMEOUT_S = 4, 10
BOUND_S = 10 * TIMEOUT_S  # a hang, not a slow machine: the measured times are far below (docs/reliability.md)


def _ranks(ns: str) -> list[int]:
    """Training ranks alive in namespace `ns`: `python -u .../training/train.py ...` as DeepSpeed's per-node
    launcher spawns them (not the runner, pdsh, ssh or that launcher, whose command lines name train.py too)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    alive = []
    for pid in out:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if len(argv) > 2 and argv[1] == "-u" and argv[2].endswith("training/train.py"):  # as DeepSpeed spawns it
            alive.append(int(pid))
    return alive


def _steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run_dir) if "loss" in r]


@pytest.fixture(scope="module")
def lost(cluster, runs_root):
    a, b = cluster.nodes
    run_dir = runs_root / "multinode" / "node_lost"
    fault = {"K3_FAULT_PAUSE_AT_STEP": str(CUT_AFTER), "K3_FAULT_RANK": "1", "K3_FAULT_PAUSE_S": "3"}
    p = start_multinode(cluster, run_dir, [*JOB, f"parallel.timeout_s={TIMEOUT_S}"], env=fault)
    out: dict = {"run_dir": run_dir}
    try:
        deadline = time.monotonic() + 300
        while CUT_AFTER not in _steps(run_dir):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        cut = time.monotonic()
        subprocess.run(["ip", "-n", b.name, "link", "set", IFNAME, "down"], check=True)
        exited: dict[str, float] = {}
        while len(exited) < 3 and time.monotonic() - cut < BOUND_S:
            done = {"rank0": not _ranks(a.name), "rank1": not _ranks(b.name), "launcher": p.poll() is not None}
            for key in done:
                if done[key] and key not in exited:
                    exited[key] = time.monotonic() - cut
            time.sleep(0.1)
        out.update(exited=exited, rc=p.poll())
    finally:
        if p.poll() is None:
            p.kill()
        stdout, stderr = p.communicate()
        subprocess.run(["ip", "-n", b.name, "link", "set", IFNAME, "up"], check=True)
    out["log"] = stdout + stderr
    out["steps_before"] = _steps(run_dir)
    ckpts = run_dir / "checkpoints"
    out["latest_before"] = (ckpts / "latest").read_text().strip()
    out["tags_before"] = sorted(p.name for p in ckpts.glob("step_*"))
    from training.checkpoint.safe_load import verify_checkpoint

    verify_checkpoint(str(ckpts / out["latest_before"]))  # raises CheckpointError when damaged
    out["verified"] = out["latest_before"]
    print(f"node lost after step {CUT_AFTER}: seconds to exit {out['exited']} (timeout_s={TIMEOUT_S})")
    print("\n".join(ln for ln in out["log"].splitlines() if any(w in ln for w in ("error", "Timed out", "pdsh@"))))
    # node 1 alone: world size 1, EP=1, the same global batch (GA 2), resume=auto from the last complete checkpoint
    alone = [*JOB, "parallel.ep_size=1", "train.grad_accum=2"]
    out["restart"] = multinode(cluster, run_dir, alone, 1, hosts=1)
    return out


def test_every_rank_and_the_launcher_exit_after_a_node_is_cut_off(lost):
    assert sorted(lost["exited"]) == ["launcher", "rank0", "rank1"], (lost["exited"], lost["log"][-4000:])
    assert lost["rc"] not in (0, None)


def test_the_surviving_rank_fails_in_its_collective_not_elsewhere(lost, cluster):
    node1 = [ln for ln in lost["log"].splitlines() if ln.startswith(f"{cluster.nodes[0].addr}: ")]
    assert any(w in ln for ln in node1 for w in ("Timed out", "timed out", "Connection closed")), lost["log"][-4000:]


def test_the_last_complete_checkpoint_is_intact_and_nothing_newer_exists(lost):
    assert lost["latest_before"] == lost["verified"] == f"step_{EVERY:08d}"
    assert lost["tags_before"] == [f"step_{EVERY:08d}"]
    assert lost["steps_before"] == list(range(1, CUT_AFTER + 1))  # step 4 ran; it is the one step lost


def test_node_one_alone_continues_from_the_checkpoint_with_the_optimizer_state(lost, two_nodes):
    res = lost["restart"]
    assert res.returncode == 0, res.tail()
    launch = next(ln for ln in res.stderr.splitlines() if ln.startswith("launch: "))
    assert "--num_gpus 1" in launch
    got, ref = res.losses(), two_nodes.losses()  # the last record of a step wins: the restart's
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[EVERY + 1] == ref[EVERY + 1]  # the same weights: the first step after resuming is bitwise
    for s in range(EVERY + 1, STEPS + 1):  # the Adam moments travelled: later steps agree to fp32 rounding
        assert abs(got[s] - ref[s]) <= 1e-6 * abs(ref[s]), (s, got[s], ref[s])


def test_only_a_backend_collective_failure_counts_as_a_lost_peer():
    import torch.distributed as dist

    from training.distributed import peer_lost

    gloo = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation"
    assert peer_lost(RuntimeError(gloo))
    assert peer_lost(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert peer_lost(dist.DistBackendError("NCCL communicator was aborted"))
    assert not peer_lost(RuntimeError("DataLoader worker timed out"))  # not a collective: the traceback stays
    assert not peer_lost(ValueError("gloo timed out"))
