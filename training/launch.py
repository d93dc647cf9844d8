"""Every deepspeed launch the project makes, in one place: the command line, and a master port that is free.

The deepspeed launcher's default master port is 29500 for every job, so two jobs on one machine (two smoke runs,
two `make test`, a sweep beside a test) collide in torch.distributed's rendezvous: the second job's ranks join the
first job's store, or its launcher dies with "address already in use". Here a job gets a free port on the master
host unless the caller names one (MASTER_PORT / --master_port), so launches never share one.

A port that is free when chosen must stay free for the seconds until rank 0's store binds it (after its imports).
The OS's choice for a bind to port 0 does not: it comes from the ephemeral range, where every outgoing connection
(gloo's pair sockets of the jobs already running, among others) takes ports too, and one took a chosen port in a
measured suite run (EADDRINUSE in the store). So the port comes from below that range (`ip_local_port_range`),
where the kernel never hands out ports by itself, and is reserved for a minute in a file under the temp dir, so two
launches on this machine never pick the same one while neither has bound it yet.

    python -m training.launch experiment=smoke run_dir=runs/smoke     # NUM_RANKS (2) local ranks
    HOSTFILE=launch/hostfile.example GPUS_PER_NODE=8 python -m training.launch model=small   # multi-node

Environment: NUM_RANKS / GPUS_PER_NODE (ranks per node), HOSTFILE, MASTER_ADDR (default: the hostfile's first
host), MASTER_PORT (default: a free one on the master host), NODE_RANK (with HOSTFILE: this node's launcher only,
no ssh; srun starts one per node: launch/slurm.sbatch). Arguments are Hydra overrides for training/train.py.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training.multinode import env_file, preflight

TRAIN_SCRIPT = str(Path(__file__).resolve().with_name("train.py"))
LOWEST_PORT = 20000  # chosen ports lie in [LOWEST_PORT, the ephemeral range's start): clear of well-known services
RESERVE_S = 60.0  # how long a chosen port stays reserved for its launch (rank 0 binds it within seconds)
RESERVATIONS = Path(tempfile.gettempdir()) / "k3-train-ports"
# pdsh's ssh to a node that vanished (power, network) would wait for TCP's retransmission timeout (~15 min) after
# the surviving ranks exit; keepalives end it within ~15 s so the launcher returns
SSH_KEEPALIVE = "-o ServerAliveInterval=5 -o ServerAliveCountMax=3"


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself (outgoing connections, binds to port 0)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def candidate_ports() -> range:
    """Where launches choose: below the ephemeral range, or above it when it starts too low to leave room."""
    lo, hi = ephemeral_range()
    if lo - LOWEST_PORT >= 1000:
        return range(LOWEST_PORT, lo)
    if 65535 - hi >= 1000:
        return range(hi + 1, 65536)
    return range(LOWEST_PORT, 65536)  # the kernel hands out (nearly) every port: no range is clear of it


def port_is_free(port: int) -> bool:
    """Whether a listening socket could bind `port` on every interface now (what rank 0's store will do)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def reserve(port: int, now: float | None = None) -> bool:
    """Claim `port` for RESERVE_S seconds among this machine's launches (an exclusively created file; a stale
    claim is taken over). True: ours. Without a writable temp dir every free port counts as ours."""
    now = time.time() if now is None else now
    path = RESERVATIONS / str(port)
    try:
        RESERVATIONS.mkdir(mode=0o1777, exist_ok=True)
        try:
            if now - path.stat().st_mtime < RESERVE_S:
                return False  # another launch chose it a moment ago and may not have bound it yet
            path.unlink()
        except FileNotFoundError:
            pass
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        os.utime(path, (now, now))
    except FileExistsError:
        return False  # another launch won the race for it
    except OSError:
        return True
    return True


def free_port(tries: int = 200) -> int:
    """A TCP port no socket on this machine holds, outside the kernel's ephemeral range, reserved for this
    launch (see the module docstring)."""
    ports, rng = candidate_ports(), random.SystemRandom()  # not `random`: jobs seed it alike, and would choose alike
    for _ in range(tries):
        port = rng.choice(ports)
        if port_is_free(port) and reserve(port):
            return port
    raise SystemExit(f"error: no free port in {ports.start}-{ports.stop - 1} after {tries} tries; set MASTER_PORT")


# Run on a remote master host over ssh: a free port there below its ephemeral range (no reservation file: this
# launch is the only chooser that host's ranks hear of).
_PROBE = f"""
import random, socket
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for port in random.sample(range({LOWEST_PORT}, max(lo, {LOWEST_PORT} + 1000)), 200):
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            continue
    print(port)
    break
"""


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
    ssh_opts = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))  # the options pdsh's ssh gets
    probe = f"python3 -c {shlex.quote(_PROBE)}"
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *ssh_opts, host, probe]
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
    """Exec the deepspeed launcher for training/train.py with the overrides in `argv` (see the module docstring).
    With a HOSTFILE, every node is checked first and the ranks' environment is handed to the other nodes
    (training/multinode.py)."""
    env = os.environ
    num_gpus = int(env.get("NUM_RANKS") or env.get("GPUS_PER_NODE") or 2)
    hostfile, master_port = env.get("HOSTFILE") or None, env.get("MASTER_PORT") or None
    extra: list[str] = []
    if hostfile and env.get("NODE_RANK"):  # one launcher per node, started by srun (no ssh): DeepSpeed's --no_ssh
        if not master_port:
            raise SystemExit(
                "error: NODE_RANK is set (one launcher per node) but MASTER_PORT is not; every node's "
                "launcher needs the same one (launch/slurm.sbatch chooses it)"
            )
        extra = ["--no_ssh", "--node_rank", env["NODE_RANK"]]
    elif hostfile:
        if "ServerAlive" not in env.get("PDSH_SSH_ARGS_APPEND", ""):  # a node cut off ends its ssh, not the job
            env["PDSH_SSH_ARGS_APPEND"] = f"{SSH_KEEPALIVE} {env.get('PDSH_SSH_ARGS_APPEND', '')}".strip()
        master_port = preflight(hostfile, num_gpus, master_port) or master_port
        env["DS_ENV_FILE"] = str(env_file())  # an absolute path: DeepSpeed's runner reads it for the pdsh exports
        extra = ["--no_ssh_check"]  # done above, through the same ssh options pdsh uses
    elif master_port and not port_is_free(int(master_port)):
        raise SystemExit(f"error: MASTER_PORT {master_port} is taken on this machine; unset it or pick another")
    cmd = launch_command(
        list(sys.argv[1:] if argv is None else argv),
        num_gpus=num_gpus,
        hostfile=hostfile,
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=master_port,
    )
    cmd[1:1] = extra
    print("launch:", " ".join(cmd), file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
