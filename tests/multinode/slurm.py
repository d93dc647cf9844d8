"""A real single-host Slurm over the two namespace nodes (tests/multinode/cluster.py): munged (its own key and
socket), slurmctld on node 1, and one slurmd per node (`slurmd -N node1` in node 1's namespace, `-N node2` in
node 2's), each reached at its namespace address (NodeAddr). The configuration lives in a temp dir (SLURM_CONF);
nothing of the machine's /etc/slurm or /etc/munge is used. Every daemon is stopped at teardown (Cluster.stop).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.multinode.cluster import Cluster

NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


def _bin(name: str) -> str:
    """The daemon's or client's path (root's PATH may lack /usr/sbin)."""
    return shutil.which(name) or str(Path("/usr/sbin", name))


def unavailable() -> str | None:
    missing = [c for c in NEEDED if not Path(_bin(c)).exists()]
    if missing:
        return f"Slurm fixture needs {', '.join(missing)} (apt-get install slurm-wlm munge; .ci/run does)"
    return None


SLURM_CONF = """\
ClusterName=k3test
SlurmctldHost={host}({ctl_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
PlugStackConfig={root}/plugstack.conf
{nodes}
PartitionName=k3 Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""


CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
"""


@dataclass
class Slurm:
    root: Path
    conf: Path
    names: list[str]

    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}


def _wait(what: str, ok, timeout: float = 30.0, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ok():
            return
        time.sleep(0.2)
    tail = log.read_text()[-2000:] if log and log.is_file() else ""
    raise RuntimeError(f"{what} not up after {timeout:.0f} s\n{tail}")


def bring_up_slurm(cluster: Cluster) -> Slurm:
    """munged, slurmctld (node 1), slurmd per node; registered as the cluster's processes (stopped with it)."""
    root = cluster.root / "slurm"
    (root / "state").mkdir(parents=True)
    for i in range(len(cluster.nodes)):
        (root / f"spool-node{i + 1}").mkdir()
    os.chmod(root, 0o755)
    names = [f"node{i + 1}" for i in range(len(cluster.nodes))]
    (root / "munge.key").write_bytes(os.urandom(1024))
    os.chmod(root / "munge.key", 0o400)
    (root / "plugstack.conf").write_text("")
    (root / "cgroup.conf").write_text(CGROUP_CONF)
    cpus = len(os.sched_getaffinity(0))
    nodes = "\n".join(
        f"NodeName={name} NodeAddr={n.addr} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
        for name, n in zip(names, cluster.nodes)
    )
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=socket.gethostname(), ctl_addr=cluster.nodes[0].addr, root=root, nodes=nodes, names=",".join(names)
        )
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    first = cluster.nodes[0]
    munge = [
        _bin("munged"), "--foreground", "--force", f"--key-file={root}/munge.key", f"--socket={root}/munge.sock",
        f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed",
    ]  # fmt: skip
    cluster.start(first, munge, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait("munged", (root / "munge.sock").exists, log=root / "munged.log")
    cluster.start(first, [_bin("slurmctld"), "-D", "-i"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for name, n in zip(names, cluster.nodes):
        slurmd = f"mount -t tmpfs tmpfs /sys/fs/cgroup && exec {_bin('slurmd')} -D -N {name}"
        cluster.start(n, ["sh", "-c", slurmd], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    slurm = Slurm(root, conf, names)

    def idle() -> bool:
        out = subprocess.run(
            cluster.netns(first, [_bin("sinfo"), "-h", "-N", "-o", "%N %t"]), env=env, capture_output=True, text=True
        ).stdout.split()
        return out.count("idle") == len(names)

    _wait("the Slurm nodes", idle, 60, root / "slurmctld.log")
    return slurm
