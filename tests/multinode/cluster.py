"""Two "nodes" on this machine: Linux network namespaces joined by a veth pair, each with its own private address
and a real sshd listening on it; passwordless keys made for the test. Nothing leaves the machine: the only link
the namespaces have is the one between them (the root namespace has no end of it), and every address a test uses
is one this module assigned.

The namespaces share the filesystem, so the checkout and its venv sit at the same path on both nodes: the shared
filesystem case. Hostnames do not resolve inside the namespaces (they share /etc/hosts with the machine), so the
hostfile names the nodes by address, as a cluster without DNS for its fabric would.

Every process started here (sshd per node, and whatever a test starts inside a namespace and registers) is
stopped at teardown and the namespaces are deleted, on failure too.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

IFNAME = "k3eth0"  # the same interface name on every node (GLOO_SOCKET_IFNAME names one interface for all)
SUBNET = "10.231.7"  # private; the pair is isolated, so two clusters on one machine may reuse it
NEEDED = ("ip", "/usr/sbin/sshd", "ssh", "ssh-keygen", "pdsh")


def unavailable() -> str | None:
    """Why two namespaced nodes cannot be built here (one line), or None."""
    if os.geteuid() != 0:
        return "multi-node fixture needs root (ip netns)"
    missing = [c for c in NEEDED if not shutil.which(c)]
    if missing:
        return f"multi-node fixture needs {', '.join(missing)} (apt-get install openssh-server pdsh; .ci/run does)"
    probe = f"k3probe{uuid.uuid4().hex[:8]}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "multi-node fixture: `ip netns add` is not permitted on this machine"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class Node:
    name: str  # the network namespace
    addr: str


@dataclass
class Cluster:
    nodes: list[Node]
    root: Path  # temp dir: keys, ssh config, sshd configs, logs
    ssh_config: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def netns(self, node: Node, cmd: list[str]) -> list[str]:
        """`cmd` run inside `node`'s namespace."""
        return ["ip", "netns", "exec", node.name, *cmd]

    def start(self, node: Node, cmd: list[str], **kw) -> subprocess.Popen:
        """A process inside `node`, stopped at teardown (its own process group)."""
        p = subprocess.Popen(self.netns(node, cmd), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def hostfile(self, path: Path, slots: int) -> Path:
        path.write_text("".join(f"{n.addr} slots={slots}\n" for n in self.nodes))
        return path

    def env(self) -> dict[str, str]:
        """What a launch on these nodes needs besides the usual: ssh through the test's config (pdsh's own
        variable, honoured by training/launch.py too) and gloo on the nodes' interface."""
        return {"PDSH_SSH_ARGS_APPEND": f"-F {self.ssh_config}", "GLOO_SOCKET_IFNAME": IFNAME}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for n in self.nodes:
            kill_namespace_processes(n.name)
            subprocess.run(["ip", "netns", "del", n.name], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process living in namespace `ns` (ranks a dead launcher left, a test's leftovers)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


SSHD_CONFIG = """\
ListenAddress {addr}
Port 22
HostKey {root}/host_key
PidFile {root}/sshd-{name}.pid
AuthorizedKeysFile {root}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitUserEnvironment no
AcceptEnv none
"""

SSH_CONFIG = """\
Host {pattern}
  User root
  IdentityFile {root}/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile {root}/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 5
  LogLevel ERROR
"""


def _wait_listening(cluster: Cluster, node: Node, port: int, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        probe = f"import socket; socket.create_connection(('{node.addr}', {port}), 1).close()"
        if subprocess.run(cluster.netns(node, ["python3", "-c", probe]), capture_output=True).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {node.addr}:{port} in {node.name} after {timeout:.0f} s")


def remove_stale() -> None:
    """Namespaces (and what runs in them) a killed test session left: named `k3n<its pid>x...`, that pid gone."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in (line.split()[0] for line in out.splitlines() if line.strip()):
        m = re.fullmatch(r"k3n(\d+)x\w+", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            kill_namespace_processes(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def bring_up(n_nodes: int = 2) -> Cluster:
    """Namespaces, the link between them, keys, an sshd per node; the caller must `stop()` it (also on error)."""
    remove_stale()
    tag = f"{os.getpid()}x{uuid.uuid4().hex[:4]}"
    root = Path(tempfile.mkdtemp(prefix="k3-cluster-"))
    os.chmod(root, 0o700)
    nodes = [Node(f"k3n{tag}{i + 1}", f"{SUBNET}.{i + 1}") for i in range(n_nodes)]
    cluster = Cluster(nodes, root, root / "ssh_config")
    try:
        for n in nodes:
            _sh("ip", "netns", "add", n.name)
            _sh("ip", "-n", n.name, "link", "set", "lo", "up")
            # IPv4 only: no IPv6 link-local addresses, router solicitations or DAD on the link
            _sh("ip", "netns", "exec", n.name, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6")
        if n_nodes != 2:
            raise ValueError("a veth pair joins exactly two nodes")
        a, b = nodes
        _sh("ip", "link", "add", IFNAME, "netns", a.name, "type", "veth", "peer", "name", IFNAME, "netns", b.name)
        for n in nodes:
            _sh("ip", "-n", n.name, "addr", "add", f"{n.addr}/24", "dev", IFNAME)
            _sh("ip", "-n", n.name, "link", "set", IFNAME, "up")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "id_ed25519"))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key"))
        shutil.copy(root / "id_ed25519.pub", root / "authorized_keys")
        host_pub = (root / "host_key.pub").read_text().split()[:2]
        (root / "known_hosts").write_text(f"{','.join(n.addr for n in nodes)} {' '.join(host_pub)}\n")
        cluster.ssh_config.write_text(SSH_CONFIG.format(pattern=f"{SUBNET}.*", root=root))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        for n in nodes:
            cfg = root / f"sshd-{n.name}.conf"
            cfg.write_text(SSHD_CONFIG.format(addr=n.addr, root=root, name=n.name))
            log = open(root / f"sshd-{n.name}.log", "w")
            cluster.start(n, ["/usr/sbin/sshd", "-D", "-e", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
        for n in nodes:
            _wait_listening(cluster, n, 22)
    except BaseException:
        cluster.stop()
        raise
    return cluster
