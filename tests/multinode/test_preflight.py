"""Before any rank starts, `launch/multinode.sh` checks every node (training/multinode.py) and turns each way a
multi-node launch goes wrong into one line naming the node and the fix, with a non-zero exit:
an unreachable host, a node without the venv (or the checkout), a port taken on the master, a hostfile with more
slots than a node has. And what the other nodes' ranks are handed (DS_ENV_FILE)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.distributed.conftest import REPO, job_env
from training.multinode import env_file, parse_hostfile

pytestmark = pytest.mark.distributed


def _launch(cluster, tmp_path, lines: str, extra: dict[str, str] | None = None, ranks: int = 1):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(lines)
    env = job_env({**cluster.env(), "HOSTFILE": str(hostfile), "GPUS_PER_NODE": str(ranks), **(extra or {})})
    cmd = cluster.netns(cluster.nodes[0], ["launch/multinode.sh", f"run_dir={tmp_path / 'run'}", "experiment=tiny_ci"])
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _one_line_error(p) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and lines and lines[-1].startswith("error: "), (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "launch: " not in p.stderr  # refused before the launcher started
    return lines[-1]


def test_an_unreachable_host_is_named(cluster, tmp_path):
    a, b = cluster.nodes
    # node 2's address, on a port where no sshd listens (pdsh's ssh options carry the port, as on a real cluster)
    p = _launch(
        cluster,
        tmp_path,
        f"{a.addr} slots=1\n{b.addr} slots=1\n",
        {"PDSH_SSH_ARGS_APPEND": f"-F {cluster.ssh_config} -p 2222"},
    )
    line = _one_line_error(p)
    assert f"node {a.addr} is unreachable over ssh" in line and "Connection refused" in line


def test_a_port_taken_on_the_master_is_named(cluster, tmp_path):
    a, b = cluster.nodes
    holder = cluster.start(
        a,
        [
            sys.executable,
            "-c",
            "import socket,time; s=socket.socket(); s.bind(('', 23999)); s.listen(); time.sleep(60)",
        ],
    )
    try:
        probe = "import socket; socket.create_connection(('127.0.0.1', 23999), 1)"
        for _ in range(100):
            if subprocess.run(cluster.netns(a, [sys.executable, "-c", probe]), capture_output=True).returncode == 0:
                break
        p = _launch(cluster, tmp_path, f"{a.addr} slots=1\n{b.addr} slots=1\n", {"MASTER_PORT": "23999"})
    finally:
        holder.kill()
    line = _one_line_error(p)
    assert line.startswith(f"error: MASTER_PORT 23999 is taken on the master {a.addr}")


def test_more_slots_than_the_node_has_is_named(cluster, tmp_path):
    a, b = cluster.nodes
    p = _launch(cluster, tmp_path, f"{a.addr} slots=1\n{b.addr} slots=512\n")
    assert f"gives {b.addr} slots=512 but it has" in _one_line_error(p)
    p = _launch(cluster, tmp_path, f"{a.addr} slots=1\n{b.addr} slots=1\n", ranks=512)
    assert _one_line_error(p).startswith("error: GPUS_PER_NODE=512 but node")


def test_a_node_without_the_venv_or_the_checkout_is_named(cluster):
    b = cluster.nodes[1]
    code = (
        "import sys\nfrom training.multinode import _probe\n"
        "try:\n    _probe(sys.argv[1], sys.argv[2], sys.argv[3], -1)\nexcept SystemExit as e:\n    print(e)\n"
    )
    run = [sys.executable, "-c", code, b.addr]
    env = job_env(cluster.env())

    def probe(root: str, python: str) -> str:
        cmd = cluster.netns(cluster.nodes[0], [*run, root, python])
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True).stdout.strip()

    assert probe(str(REPO), "/opt/no-venv/bin/python") == (
        f"error: node {b.addr} has no /opt/no-venv/bin/python; install the venv at the same path on every node"
    )
    assert probe("/opt/no-checkout", sys.executable).startswith(
        f"error: node {b.addr} has no checkout at /opt/no-checkout;"
    )


def test_a_malformed_hostfile_line_is_named(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=8\nnode2 8\n")
    with pytest.raises(SystemExit, match=r"hostfile:2: `node2 8` is not `host slots=N`"):
        parse_hostfile(str(hostfile))


def test_the_other_nodes_get_the_rank_environment_and_the_users_deepspeed_env(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "repo"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5\n\n")
    environ = {
        "GLOO_SOCKET_IFNAME": "eth1",
        "NCCL_SOCKET_IFNAME": "ib0",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "4",
        "K3_FAULT_RANK": "1",
        "WANDB_MODE": "offline",
        "HOME": str(home),
        "SECRET_TOKEN": "x",
        "NCCL_DEBUG_FILE": "/tmp/$x",  # DeepSpeed cannot quote `$`: stays home
    }
    lines = env_file(environ, home=str(home), cwd=str(cwd)).read_text().splitlines()
    assert lines[-1] == "NCCL_IB_HCA=mlx5"  # the user's own file last: its lines win (DeepSpeed keeps the last)
    assert set(lines[:-1]) == {
        "DS_ACCELERATOR=cpu",
        "GLOO_SOCKET_IFNAME=eth1",
        "K3_FAULT_RANK=1",
        "NCCL_SOCKET_IFNAME=ib0",
        "OMP_NUM_THREADS=4",
        "WANDB_MODE=offline",
    }


def test_a_taken_master_port_on_this_machine_is_named_before_any_launch():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        env = job_env({"MASTER_PORT": str(port), "NUM_RANKS": "2"})
        env.pop("HOSTFILE", None)
        p = subprocess.run([sys.executable, "-m", "training.launch"], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode != 0 and p.stderr.strip() == (
        f"error: MASTER_PORT {port} is taken on this machine; unset it or pick another"
    ), p.stderr
