"""Streaming safetensors shards: plan from sizes, write one tensor at a time (issue 37 §1, §2).

An `Entry` is an output tensor known by name, shape and dtype before it exists; `make()` materialises it from the
checkpoint. Shards are planned from the sizes alone (greedy, in entry order, `max_shard_bytes` each), so every
process of a parallel export computes the same plan and writes its own shards. A shard is written as the
safetensors format specifies (8-byte little-endian header length, JSON header with `data_offsets`, then the raw
little-endian bytes), header first, then tensor after tensor: the working set is one tensor, not one shard.
`model.safetensors.index.json` is written last, by one process, once every shard exists.
"""

from __future__ import annotations

import gc
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

# Test seam: called with the path of each shard once it is complete (fault-injection tests kill the export here).
on_shard_written: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Entry:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class Unmapper:
    """`after_each` for write_shard: the source's `release()` once about `every` bytes of the checkpoint were
    mapped since the last one (re-opening a mapped file per tensor would re-read its pickle every time). An entry
    reads its elements in fp32 (4 bytes each); a uint8 MXFP4 entry packs 2 elements per byte (8 bytes read)."""

    def __init__(self, release: Callable[[], None], every: int = 64 * 1024**2) -> None:
        self.release, self.every, self.read = release, every, 0

    def __call__(self, e: Entry) -> None:
        self.read += math.prod(e.shape) * (8 if e.dtype == torch.uint8 else 4)
        if self.read >= self.every:
            self.release()
            gc.collect()  # torch.load's mapped storage can sit in a reference cycle: unmapped only when collected
            self.read = 0


def plan_shards(entries: Sequence[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Entries in order, cut into shards of at most `max_shard_bytes` (a bigger tensor gets a shard of its own)."""
    shards: list[list[Entry]] = [[]]
    used = 0
    for e in entries:
        if shards[-1] and used + e.nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(e)
        used += e.nbytes
    return shards


def shard_names(n: int) -> list[str]:
    return [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_shard(path: str, entries: Sequence[Entry], after_each: Callable[[Entry], None] | None = None) -> None:
    """One safetensors file, streamed: the header from the entries' shapes, then each tensor as it is made;
    `after_each(entry)` runs after every tensor (the export drops the source's file maps there: mapped pages
    count in RSS)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": _DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for e in entries:
            t = e.make()
            if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                raise ValueError(f"export: {e.key} came out {t.dtype} {tuple(t.shape)}, planned {e.dtype} {e.shape}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t
            if after_each is not None:
                after_each(e)
        f.flush()
        os.fsync(f.fileno())
    if on_shard_written is not None:
        on_shard_written(path)


def write_shards(
    out_dir: str,
    shards: list[list[Entry]],
    rank: int = 0,
    procs: int = 1,
    after_each: Callable[[Entry], None] | None = None,
) -> list[str]:
    """Write the shards `i % procs == rank` of the plan into `out_dir`; returns their names."""
    names = shard_names(len(shards))
    for i in range(rank, len(shards), procs):
        write_shard(os.path.join(out_dir, names[i]), shards[i], after_each)
    return names[rank::procs]


def write_index(out_dir: str, shards: list[list[Entry]]) -> None:
    """The index (only for more than one shard), after every shard is on disk."""
    if len(shards) == 1:
        return
    names = shard_names(len(shards))
    missing = [n for n in names if not os.path.isfile(os.path.join(out_dir, n))]
    if missing:
        raise RuntimeError(f"export: shards {missing[:3]} were not written; the index is not written either")
    index = {
        "metadata": {"total_size": sum(e.nbytes for s in shards for e in s)},
        "weight_map": {e.key: names[i] for i, s in enumerate(shards) for e in s},
    }
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
