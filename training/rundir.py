"""The run directory before start: writable, room for the checkpoints, one job at a time, a clean start over.

`lock_run_dir` takes an exclusive `fcntl.flock` on `<run_dir>/.lock` (rank 0, held for the job's life: the
kernel drops it when the process dies, so a crash never leaves a stale lock) and writes the holder (pid, host,
start time) into it, so a second job stops with one line naming the holder. `archive_previous_run` moves a
previous run's files into `<run_dir>/archive/<UTC timestamp>/` (`checkpoint.start_over=true`).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import socket


class RunDirError(RuntimeError):
    """The run directory cannot hold this run; one line naming the directory and the fix."""


def checkpoint_bytes_estimate(n_params: int, keep_last: int) -> int:
    """fp32 weights + two Adam moments per kept checkpoint, one more being written, plus 64 MiB of slack."""
    return 12 * n_params * (keep_last + 1) + (64 << 20)


def check_run_dir(run_dir: str, need_bytes: int) -> None:
    """Create `run_dir`, write+fsync+delete a probe file and check the free space, before training starts."""
    probe = os.path.join(run_dir, f".write_probe.{os.getpid()}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise RunDirError(
            f"run_dir {run_dir} is not writable ({e.strerror or e}); choose another run_dir= or fix "
            "its permissions/free space"
        ) from None
    free = shutil.disk_usage(run_dir).free
    if free < need_bytes:
        raise RunDirError(
            f"run_dir {run_dir} has {free / 2**20:.0f} MiB free, checkpoints need about "
            f"{need_bytes / 2**20:.0f} MiB; free disk space, lower checkpoint.keep_last or choose "
            "another run_dir="
        )


LOCK_FILE = ".lock"
ARCHIVE_DIR = "archive"
_held: dict[str, int] = {}  # run_dir -> open fd of its lock (closing it would release the lock)


def lock_run_dir(run_dir: str) -> None:
    """Hold `<run_dir>/.lock` until this process exits; RunDirError naming the holder if another job has it."""
    path = os.path.join(run_dir, LOCK_FILE)
    if run_dir in _held:
        return
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunDirError(
            f"run_dir {run_dir} is not writable ({e.strerror or e}); choose another run_dir= or fix its permissions"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "holder unknown"
        os.close(fd)
        raise RunDirError(
            f"run_dir {run_dir} is in use by another job ({holder}); wait for it to end, stop it, "
            "or choose another run_dir="
        ) from None
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)
    _held[run_dir] = fd


def archive_previous_run(run_dir: str) -> str | None:
    """Move everything a previous run left in `run_dir` (checkpoints, metrics.jsonl, expert_load.jsonl,
    summary.json, wandb/, config.yaml, ...) into `archive/<UTC timestamp>/`; returns that dir (None: empty)."""
    if not os.path.isdir(run_dir):
        return None
    entries = sorted(e for e in os.listdir(run_dir) if e not in (ARCHIVE_DIR, LOCK_FILE))
    if not entries:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dst, n = os.path.join(run_dir, ARCHIVE_DIR, stamp), 1
    while os.path.exists(dst):
        dst, n = os.path.join(run_dir, ARCHIVE_DIR, f"{stamp}-{n}"), n + 1
    os.makedirs(dst)
    for e in entries:
        os.rename(os.path.join(run_dir, e), os.path.join(dst, e))
    return dst
