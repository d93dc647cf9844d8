"""Every launch picks its own free master port (training/launch.py): two jobs on one machine never meet in one
rendezvous, even with the deepspeed launcher's default port 29500 taken by someone else."""

from __future__ import annotations

import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import training.launch as launch
from tests.distributed.conftest import REPO, job_env, read_metrics
from training.launch import candidate_ports, ephemeral_range, first_host, free_port, launch_command, reserve

DEFAULT_PORT = 29500


def _port(cmd: list[str]) -> int:
    return int(cmd[cmd.index("--master_port") + 1])


def test_a_launch_gets_a_port_nothing_holds():
    cmd = launch_command(["experiment=smoke"], 2)
    with socket.socket() as s:
        s.bind(("", _port(cmd)))  # raises if the port were held


def test_chosen_ports_lie_outside_the_kernels_ephemeral_range(tmp_path, monkeypatch):
    """The kernel never hands a chosen port to an outgoing connection (gloo's pair sockets) before rank 0 binds it."""
    monkeypatch.setattr(launch, "RESERVATIONS", tmp_path / "ports")  # claims nothing real launches would skip
    lo, hi = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert all(p in candidate_ports() and not lo <= p <= hi for p in ports), (lo, hi, ports)


def test_a_chosen_port_is_reserved_for_a_minute_then_free_to_take_again(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "RESERVATIONS", tmp_path / "ports")
    assert reserve(23456, now=1000.0)
    assert not reserve(23456, now=1000.0 + launch.RESERVE_S - 1)  # another launch, before rank 0 bound it
    assert reserve(23456, now=1000.0 + launch.RESERVE_S + 1)  # a stale claim is taken over


def test_launches_never_choose_a_port_another_launch_reserved(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "RESERVATIONS", tmp_path / "ports")
    monkeypatch.setattr(launch, "candidate_ports", lambda: range(24000, 24040))
    ports = [free_port() for _ in range(30)]
    assert len(set(ports)) == 30


def test_a_port_held_by_a_listener_is_never_chosen(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "RESERVATIONS", tmp_path / "ports")
    with socket.socket() as held:
        held.bind(("", free_port()))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(launch, "candidate_ports", lambda: range(port, port + 1))
        with pytest.raises(SystemExit, match=f"no free port in {port}-{port}.*set MASTER_PORT"):
            free_port(tries=5)


def test_a_given_master_port_is_used_as_given():
    assert _port(launch_command([], 2, master_port=31337)) == 31337


def test_the_hostfile_first_host_is_the_master(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nodes\n\nlocalhost slots=2\nnode2 slots=2\n")
    cmd = launch_command(["model=small"], 2, hostfile=str(hostfile))
    assert first_host(str(hostfile)) == "localhost"
    assert cmd[cmd.index("--master_addr") + 1] == "localhost" and cmd[cmd.index("--hostfile") + 1] == str(hostfile)
    assert cmd[-1] == "model=small"


def test_an_empty_hostfile_is_refused_in_one_line(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nothing\n")
    with pytest.raises(SystemExit, match="lists no host"):
        launch_command([], 2, hostfile=str(hostfile))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_smoke_runs_at_once_both_train_with_the_default_port_taken(tmp_path):
    """Two `launch/smoke.sh` side by side (2 ranks each), while another process listens on 29500."""
    env = job_env()
    env.pop("MASTER_PORT", None)

    def smoke(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        run_dir = tmp_path / name
        cmd = ["bash", "launch/smoke.sh", "train.steps=2", "checkpoint.every=0", "logging.mode=disabled"]
        cmd.append(f"run_dir={run_dir}")
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600), run_dir

    with socket.socket() as squatter:
        try:
            squatter.bind(("", DEFAULT_PORT))
            squatter.listen()
        except OSError:
            pass  # someone else holds 29500 already: the same situation
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(smoke, ["a", "b"]))
    for p, run_dir in results:
        assert p.returncode == 0, p.stderr[-2000:]
        assert [r["step"] for r in read_metrics(run_dir) if "loss" in r][-1] == 2  # trained to the end
    ports = {_port(line.split()) for p, _ in results for line in p.stderr.splitlines() if line.startswith("launch:")}
    assert len(ports) == 2 and DEFAULT_PORT not in ports
