"""Start-up checks of the run directory: writable, and room for the checkpoints, before any process group."""
from __future__ import annotations

import os
import shutil


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
        raise RunDirError(f"run_dir {run_dir} is not writable ({e.strerror or e}); choose another run_dir= or fix "
                          "its permissions/free space") from None
    free = shutil.disk_usage(run_dir).free
    if free < need_bytes:
        raise RunDirError(f"run_dir {run_dir} has {free / 2**20:.0f} MiB free, checkpoints need about "
                          f"{need_bytes / 2**20:.0f} MiB; free disk space, lower checkpoint.keep_last or choose "
                          "another run_dir=")
