"""An export's output directory appears whole or not at all (issue 37 §5).

Everything is written into a staging directory beside OUT (`.<name>.partial-<pid>`, same filesystem) and renamed
onto OUT at the end, so a killed export leaves a hidden `.partial` directory, never a directory that looks like a
checkpoint. An existing non-empty OUT is refused in one line unless `overwrite`; then the new directory replaces
it with one atomic `renameat2(RENAME_EXCHANGE)` where Linux offers it (else: old aside, new in place, old
removed). Staging directories of exports that died (their pid is gone) are removed by the next export to OUT.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import shutil
from typing import Iterator

from training.tools.cli import ToolError

_RENAME_EXCHANGE = 2  # linux/fs.h


def _staging_glob(out: str) -> str:
    parent, name = os.path.split(os.path.abspath(out))
    return os.path.join(parent, f".{name}.partial-*")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_staging(out: str) -> None:
    for d in glob.glob(_staging_glob(out)):
        pid = d.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directories (Linux renameat2); False where the call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def check_out(out: str, overwrite: bool) -> None:
    """Refuse (one line) a non-empty OUT unless `overwrite`; a plain file at OUT is always refused."""
    if os.path.isfile(out):
        raise ToolError(f"{out} is a file; pass a directory path for the export")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ToolError(f"{out} exists and is not empty; pass --overwrite to replace it, or pick another directory")


def new_staging(out: str) -> str:
    """A fresh `.<name>.partial-<pid>` beside `out` (dead exports' leftovers removed first)."""
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    _remove_dead_staging(out)
    parent, name = os.path.split(out)
    staging = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


@contextlib.contextmanager
def staged_output(out: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh staging directory beside `out`; on normal exit it becomes `out`, on an exception it is
    removed (a kill leaves it hidden, to be swept by the next export)."""
    check_out(out, overwrite)
    out = os.path.abspath(out)
    staging = new_staging(out)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish(staging, out)


def publish(staging: str, out: str) -> None:
    """Move the finished `staging` onto `out` (replacing an existing `out` as atomically as the OS allows)."""
    if not os.path.exists(out) or (os.path.isdir(out) and not os.listdir(out)):
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(staging, out)
        return
    if _exchange(staging, out):  # out is the new export now; staging holds the old one
        shutil.rmtree(staging, ignore_errors=True)
        return
    old = staging + ".old"
    os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)
