"""Atomic file writes: the one helper data/ (and training/) use, so a crash mid-write never leaves a torn file.

Write to a temporary file in the target directory, fsync it, then `os.replace` it over the target (atomic on
POSIX and Windows for paths on one filesystem). Readers see the old file or the new one, never a prefix: several
ranks may build the same cached corpus or tokenizer at once and the last replace simply wins with equal bytes.
`atomic_dir` does the same for a directory built in place (a cached tokenizer directory).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Union


@contextlib.contextmanager
def atomic_open(path: Union[str, os.PathLike], mode: str = "w", mode_bits: int = 0o644) -> Iterator[IO]:
    """Open a temporary sibling of `path` for writing; on a clean exit it is fsynced and replaces `path`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open mode must be 'w' or 'wb', got {mode!r}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".tmp-{out.name}-")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode_bits)  # mkstemp makes 0600; caches may be shared
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: Union[str, os.PathLike], data: Union[bytes, str]) -> Path:
    """Write `data` (bytes, or str as UTF-8) to `path` atomically; returns the path."""
    with atomic_open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


@contextlib.contextmanager
def atomic_dir(path: Union[str, os.PathLike]) -> Iterator[Path]:
    """Build a directory under a temporary sibling name; on a clean exit it is renamed to `path`.

    The rename is atomic, so readers never see a half-written directory. If another process finished the same
    directory first (a cache shared by ranks), its copy is kept and this one discarded."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}-"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, out)
        except OSError:
            if not out.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
