"""Before a multi-node launch: every node answers, has the checkout and venv, has the slots the hostfile claims,
and the master port is free on the master; then the environment the ranks need on the other nodes.

The deepspeed launcher (pdsh over ssh) starts `<this venv's python> -m deepspeed.launcher.launch` in this checkout's
path on every host, and a node that cannot do that fails late and far away (a pdsh line among hundreds, ranks
waiting for a peer until the rendezvous times out). One ssh per node first, all at once, turns each of those into
one line naming the node and the fix, before any rank starts:

    error: node 10.0.0.2 is unreachable over ssh (ssh: connect to host 10.0.0.2 port 22: No route to host); ...

The other nodes' ranks see only what the ssh command line exports: DeepSpeed exports `PYTHON*` variables and the
lines of a `.deepspeed_env` file (DS_ENV_FILE names it). `env_file` writes one with the variables that steer a rank
here (DS_ACCELERATOR, OMP_NUM_THREADS, GLOO_*/NCCL_* socket interfaces and timeouts, W&B, HF, K3_*), then the
lines of any `.deepspeed_env` the user keeps in ~ or the checkout (they win), so a node does not fall back to other
defaults.

ssh here reads the options pdsh is given for its own ssh (PDSH_SSH_ARGS_APPEND: an `-F ssh_config`, a port, a key),
so the pre-flight and the launch reach the nodes the same way.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

FORWARD = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_EXTENSIONS_DIR")
FORWARD_PREFIXES = ("GLOO_", "NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "WANDB_", "HF_", "K3_")
SSH_TIMEOUT_S = 10

# Run on each node with its venv's python in the checkout: its usable CPUs, its GPUs, and (on the master) the port
# to use: the one asked for if it is free, else a free one of training/launch.py's candidate range. Exit 5: taken.
_PROBE = """
import os, random, shutil, subprocess, sys
from training.launch import candidate_ports, port_is_free
gpus = 0
if shutil.which("nvidia-smi"):
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    gpus = sum(1 for line in out.splitlines() if line.startswith("GPU "))
print("cpus", len(os.sched_getaffinity(0)), "gpus", gpus)
want = int(sys.argv[1])
if want > 0:
    if not port_is_free(want):
        sys.exit(5)
    print("port", want)
elif want == 0:
    ports = candidate_ports()
    for port in random.SystemRandom().sample(ports, min(200, len(ports))):
        if port_is_free(port):
            print("port", port)
            break
"""


@dataclass
class NodeReport:
    host: str
    cpus: int
    gpus: int
    port: int | None


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """`host slots=N` lines (`#` comments, blank lines) in order; one line per malformed entry is refused."""
    hosts: list[tuple[str, int]] = []
    try:
        text = Path(path).read_text()
    except OSError as e:
        why = f"error: cannot read HOSTFILE {path} ({e.strerror}); write one `host slots=N` per node"
        raise SystemExit(why) from None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].startswith("slots=") or not parts[1][6:].isdigit():
            raise SystemExit(f"error: {path}:{n}: `{line}` is not `host slots=N`")
        hosts.append((parts[0], int(parts[1][6:])))
    if not hosts:
        raise SystemExit(f"error: hostfile {path} lists no host; add lines like `node1 slots=8`")
    return hosts


def ssh_command(host: str, remote: str) -> list[str]:
    """ssh to `host` as pdsh does (PDSH_SSH_ARGS_APPEND), never prompting."""
    extra = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}", *extra, host, remote]


def _probe(host: str, root: str, python: str, port: int) -> NodeReport:
    remote = (
        f"cd {shlex.quote(root)} 2>/dev/null || exit 3; test -x {shlex.quote(python)} || exit 4; "
        f"exec {shlex.quote(python)} -c {shlex.quote(_PROBE)} {port}"
    )
    try:
        p = subprocess.run(ssh_command(host, remote), capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 20)
    except subprocess.TimeoutExpired:
        why = f"error: node {host} did not answer over ssh in {SSH_TIMEOUT_S + 20} s; check the hostfile"
        raise SystemExit(why) from None
    if p.returncode == 255:
        why = (p.stderr.strip().splitlines() or ["no answer"])[-1]
        raise SystemExit(
            f"error: node {host} is unreachable over ssh ({why}); fix the hostfile or passwordless ssh to it"
        )
    if p.returncode == 3:
        raise SystemExit(
            f"error: node {host} has no checkout at {root}; every node runs the launch from the same path "
            "(a shared filesystem, or the same clone there)"
        )
    if p.returncode == 4:
        raise SystemExit(f"error: node {host} has no {python}; install the venv at the same path on every node")
    if p.returncode == 5:
        raise SystemExit(
            f"error: MASTER_PORT {port} is taken on the master {host}; unset MASTER_PORT (a free one is chosen) "
            "or pick another"
        )
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        raise SystemExit(f"error: node {host}: the pre-flight check failed ({why})")
    words = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    cpus_gpus = words["cpus"].split()
    return NodeReport(host, int(cpus_gpus[0]), int(cpus_gpus[2]), int(words["port"]) if "port" in words else None)


def preflight(hostfile: str, ranks_per_node: int, master_port: int | None, root: str | None = None) -> int | None:
    """Check every node of `hostfile` at once (see the module docstring); returns the master port (the one given,
    checked free on the master, or one chosen free there as training/launch.py chooses). One-line SystemExit on the
    first problem."""
    hosts = parse_hostfile(hostfile)
    root = root or os.getcwd()
    with ThreadPoolExecutor(min(32, len(hosts))) as pool:
        want = [int(master_port or 0)] + [-1] * (len(hosts) - 1)  # the master: the port; the others: none
        futures = [pool.submit(_probe, host, root, sys.executable, port) for (host, _), port in zip(hosts, want)]
        reports = [f.result() for f in futures]
    for (host, slots), r in zip(hosts, reports):
        have, kind = (r.gpus, "GPUs") if r.gpus else (r.cpus, "CPUs (no GPU)")
        if slots > have:
            raise SystemExit(
                f"error: hostfile {hostfile} gives {host} slots={slots} but it has {have} {kind}; lower slots="
            )
        if ranks_per_node > have:
            raise SystemExit(f"error: GPUS_PER_NODE={ranks_per_node} but node {host} has {have} {kind}")
    return reports[0].port


def env_file(environ: dict[str, str] | None = None, home: str | None = None, cwd: str | None = None) -> Path:
    """A DS_ENV_FILE for the other nodes: this launch's variables (FORWARD, FORWARD_PREFIXES), then the user's
    `.deepspeed_env` lines (home, then checkout; DeepSpeed keeps a key's last line, so theirs win). Values DeepSpeed
    cannot quote (quotes, `$`, backslashes, newlines) stay home."""
    environ = dict(os.environ if environ is None else environ)
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    lines = [
        f"{key}={val}"
        for key, val in sorted(environ.items())
        if (key in FORWARD or key.startswith(FORWARD_PREFIXES)) and not any(c in val for c in "\"'$`\\\n")
    ]
    for base in (home or os.path.expanduser("~"), cwd or os.getcwd()):
        user = Path(base, name)
        if user.is_file():
            lines += [ln for ln in user.read_text().splitlines() if "=" in ln]
    out_dir = Path(tempfile.gettempdir()) / "k3-train-env"
    out_dir.mkdir(mode=0o1777, exist_ok=True)
    for old in out_dir.glob("env-*"):  # files of launches long gone
        try:
            if time.time() - old.stat().st_mtime > 86400:
                old.unlink()
        except OSError:
            pass
    fd, path = tempfile.mkstemp(prefix="env-", dir=out_dir, text=True)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{ln}\n" for ln in lines))
    return Path(path)
