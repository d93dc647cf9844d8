"""Ranks never outlive their launcher.

The `deepspeed` runner starts `python -m deepspeed.launcher.launch`, which starts the ranks. kill -9 of the runner
leaves `launch` and the ranks running, training and checkpointing into the run directory unsupervised. Two guards,
both CPU and GPU, Linux:

- a parent-death signal (prctl PR_SET_PDEATHSIG = SIGKILL): the kernel kills the rank when its parent (`launch`)
  dies;
- a daemon thread that polls the launcher ancestors (every process above the rank whose command line is
  DeepSpeed's: `launch` and the runner) with psutil and ends the rank, with one line on stderr, as soon as one of
  them is gone. `launch` then sees its ranks exit and ends too.

A process not started by the DeepSpeed launcher (`python -m training.train`, nohup'd or not) is left alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

import psutil

PR_SET_PDEATHSIG = 1
POLL_S = 1.0


def _is_launcher(p: psutil.Process) -> bool:
    """`python -m deepspeed.launcher.launch ...` or the `deepspeed` runner script (`[python] .../deepspeed ...`)."""
    try:
        argv = p.cmdline()
    except psutil.Error:
        return False
    return any("deepspeed.launcher" in a for a in argv) or any(os.path.basename(a) == "deepspeed" for a in argv[:2])


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def launcher_ancestors() -> list[psutil.Process]:
    """The DeepSpeed launcher processes above this one, nearest first (empty when not launched by it)."""
    out: list[psutil.Process] = []
    for p in psutil.Process().parents():
        if not _is_launcher(p):
            break
        out.append(p)
    return out


def _set_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog thread alone
        pass


def _watch(procs: list[psutil.Process], poll_s: float) -> None:
    while True:
        for p in procs:
            if _gone(p):
                print(
                    f"error: the deepspeed launcher (pid {p.pid}) is gone; stopping rank pid {os.getpid()} "
                    "(resume with checkpoint.resume=auto)",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
        time.sleep(poll_s)


def start(poll_s: float = POLL_S) -> list[int]:
    """Arm both guards when this process is a rank of the DeepSpeed launcher; returns the watched pids."""
    procs = launcher_ancestors()
    if not procs:
        return []
    parent = os.getppid()
    if procs[0].pid == parent:
        _set_pdeathsig()
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
    threading.Thread(target=_watch, args=(procs, poll_s), name="k3-launcher-watchdog", daemon=True).start()
    return [p.pid for p in procs]
