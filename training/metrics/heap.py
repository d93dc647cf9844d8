"""Peak heap bytes of this process on CPU: the analogue of `torch.cuda.max_memory_allocated` for checking memory
formulas (bench/memory.py, tests/training/test_plan.py) where no device allocator keeps statistics.

glibc's `mallinfo2` reports the bytes in use: mmapped blocks (`hblkhd`) plus arena bytes (`uordblks`). Run the
process with a fixed mmap threshold (`MALLOC_MMAP_THRESHOLD_=131072`) so every tensor above 128 KiB is its own
mapping and freed memory leaves the count at once. A background thread samples it (torch kernels release the GIL),
so transients shorter than the period can be missed: measure phases that last milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None
    return libc


def heap_supported() -> bool:
    """Whether this C library reports heap use (glibc >= 2.33)."""
    return _libc() is not None


class HeapPeak:
    """`with HeapPeak() as h: ...` -> `h.peak`: the largest in-use heap growth over the block, in bytes, relative to
    its start; `h.now()` is the current growth."""

    def __init__(self, period_s: float = 2e-4) -> None:
        self._lib = _libc()
        if self._lib is None:
            raise RuntimeError("HeapPeak needs glibc >= 2.33 (mallinfo2); measure peak RSS instead")
        self._period_s = period_s
        self._base = self._in_use()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _in_use(self) -> int:
        info = self._lib.mallinfo2()
        return int(info.hblkhd + info.uordblks)

    def now(self) -> int:
        return self._in_use() - self._base

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> HeapPeak:
        self._base = self._in_use()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
