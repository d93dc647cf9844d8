"""Dispatch-level probes shared by tests and benchmarks: host syncs and subnormal intermediates.

`count_syncs()` counts the places where a step makes the host wait for the device: on a GPU each one drains the
launch queue, so a step must make none on its hot path (docs/performance.md, "Sync budget"). On CPU nothing waits,
but the same code runs, so the count measured here is the count a CUDA run pays (fla aside). Recorded:

- `aten._local_scalar_dense`: `.item()`, `int(t)`, `float(t)`, `bool(t)` on a tensor;
- `aten.nonzero` (and boolean-mask indexing, which calls it): the output size depends on the data;
- `aten.bincount` (its output length depends on max(x) unless `minlength` covers it; CUDA reads it on the host);
- `aten.repeat_interleave.Tensor` without `output_size` (the output length is sum(repeats));
- `Tensor.tolist()`, which copies to the host without going through the dispatcher (wrapped at Python level while
  the context is open);
- `masked_select` and `unique`, whose output sizes depend on the data too.

Not counted: explicit device->host copies (`.cpu()`), which are syncs on a GPU but plain copies on a CPU-only run.

`no_subnormals()` checks the output of every aten op for fp32/fp64 values with 0 < |x| < finfo.tiny: on x86 cores
arithmetic on such operands takes a microcode assist (10-100x slower per op; docs/performance.md, "Denormals").
Both are test and benchmark machinery: model/ and training/ never import them.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
SYNC_OPS = {
    _aten._local_scalar_dense.default: "item",
    _aten.nonzero.default: "nonzero",
    _aten.bincount.default: "bincount",
    # other ops whose output size depends on the data (not in the list; counted all the same)
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_consecutive.default: "unique",
}


class SyncCounter(TorchDispatchMode):
    """Counts host syncs by kind (`counts`), with the first few call sites of each (`sites`) for a readable
    failure message. Call `backward()` inside the context: autograd carries the thread-local dispatch-mode stack
    into whichever thread runs the backward, so its ops are counted too."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.sites: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def record(self, kind: str) -> None:
        import traceback

        with self._lock:
            self.counts[kind] += 1
            sites = self.sites.setdefault(kind, [])
            if len(sites) < 3:
                frames = [f for f in traceback.extract_stack()[:-2] if "bench/probes.py" not in f.filename]
                ours = [f for f in frames if "/torch/" not in f.filename]
                sites.append(f"{'/'.join(ours[-1].filename.split('/')[-2:])}:{ours[-1].lineno}" if ours else "?")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = SYNC_OPS.get(func)
        if kind is None and func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            kind = "repeat_interleave"
        if kind is not None:
            self.record(kind)
        return func(*args, **kwargs)

    def report(self) -> str:
        return ", ".join(f"{k} x{n} (at {', '.join(self.sites.get(k, []))})" for k, n in sorted(self.counts.items()))


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    """`with count_syncs() as c: loss = model(...); loss.backward()` -> c.counts, c.total."""
    counter = SyncCounter()
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor):  # Tensor.tolist never reaches the dispatcher
        counter.record("tolist")
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


_UNINITIALISED = {  # ops that write no values (or alias without being flagged a view)
    _aten._unsafe_view,
    _aten.empty,
    _aten.new_empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.new_empty_strided,
}


class SubnormalFinder(TorchDispatchMode):
    """Records every aten op whose floating output holds a subnormal value (0 < |x| < finfo(dtype).tiny)."""

    def __init__(self) -> None:
        super().__init__()
        self.hits: Counter[str] = Counter()  # op -> calls with a subnormal output
        self.values: Counter[str] = Counter()  # op -> subnormal values it produced
        self.checked = 0  # floating outputs checked
        self.checked_values = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket in _UNINITIALISED:  # no new values: aliases, fresh memory
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64) and t.numel():
                self.checked += 1
                self.checked_values += t.numel()
                a = t.detach().abs()
                n = int(((a > 0) & (a < torch.finfo(t.dtype).tiny)).sum())
                if n:
                    self.hits[str(func)] += 1
                    self.values[str(func)] += n
        return out


@contextlib.contextmanager
def find_subnormals() -> Iterator[SubnormalFinder]:
    """`with find_subnormals() as f: ...` -> f.hits: op name -> number of calls with subnormal outputs."""
    finder = SubnormalFinder()
    with finder:
        yield finder
