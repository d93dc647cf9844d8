"""Every deepspeed launch the project makes, in one place: the command line, and a master port that is free.

The deepspeed launcher's default master port is 29500 for every job, so two jobs on one machine (two smoke runs,
two `make test`, a sweep beside a test) collide in torch.distributed's rendezvous: the second job's ranks join the
first job's store, or its launcher dies with "address already in use". Here a job gets a port the OS reports free
on the master host unless the caller names one (MASTER_PORT / --master_port), so launches never share one.

    python -m training.launch experiment=smoke run_dir=runs/smoke     # NUM_RANKS (2) local ranks
    HOSTFILE=launch/hostfile.example GPUS_PER_NODE=8 python -m training.launch model=small   # multi-node

Environment: NUM_RANKS / GPUS_PER_NODE (ranks per node), HOSTFILE, MASTER_ADDR (default: the hostfile's first
host), MASTER_PORT (default: a free one on the master host). Arguments are Hydra overrides for training/train.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

TRAIN_SCRIPT = str(Path(__file__).resolve().with_name("train.py"))
# A bind to port 0 on every interface: the OS picks a port no socket on this host holds (what the store will bind).
_PROBE = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


def free_port() -> int:
    """A TCP port no socket on this machine holds now (the OS's choice for a bind to port 0)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def first_host(hostfile: str) -> str:
    """The first host of a deepspeed hostfile (`host slots=N` lines; `#` comments): rank 0 runs there."""
    for line in Path(hostfile).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return line.split()[0]
    raise SystemExit(f"error: hostfile {hostfile} lists no host; add lines like `node1 slots=8`")


def is_this_machine(host: str) -> bool:
    """Whether `host` names this machine (localhost, its hostname, or one of its addresses)."""
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        ours = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
        return bool(ours & {info[4][0] for info in socket.getaddrinfo(host, None)})
    except OSError:
        return False


def free_port_on(host: str) -> int:
    """A free port on the master host: locally, or over the ssh the deepspeed launcher itself uses for its nodes."""
    if is_this_machine(host):
        return free_port()
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, "python3", "-c", f'"{_PROBE}"']
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        raise SystemExit(
            f"error: could not ask the master host {host} for a free port over ssh; set MASTER_PORT=<a free port>"
        ) from None


def deepspeed_bin() -> str:
    """The launcher of this interpreter's environment (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("deepspeed")
    return str(beside) if beside.is_file() else (shutil.which("deepspeed") or "deepspeed")


def launch_command(
    args: list[str],
    num_gpus: int,
    script: str = TRAIN_SCRIPT,
    hostfile: str | None = None,
    master_addr: str | None = None,
    master_port: int | str | None = None,
) -> list[str]:
    """The deepspeed launcher command for `script` with `args` on `num_gpus` ranks per node; the master port is
    `master_port` if given, else a free one on the master host (this machine without a hostfile)."""
    cmd = [deepspeed_bin(), "--no_local_rank", "--num_gpus", str(num_gpus)]
    if hostfile:
        master_addr = master_addr or first_host(hostfile)
        cmd += ["--hostfile", hostfile, "--master_addr", master_addr]
    elif master_addr:
        cmd += ["--master_addr", master_addr]
    port = master_port or free_port_on(master_addr or "localhost")
    return [*cmd, "--master_port", str(port), script, *args]


def main(argv: list[str] | None = None) -> None:
    """Exec the deepspeed launcher for training/train.py with the overrides in `argv` (see the module docstring)."""
    env = os.environ
    cmd = launch_command(
        list(sys.argv[1:] if argv is None else argv),
        num_gpus=int(env.get("NUM_RANKS") or env.get("GPUS_PER_NODE") or 2),
        hostfile=env.get("HOSTFILE") or None,
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=env.get("MASTER_PORT") or None,
    )
    print("launch:", " ".join(cmd), file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
