"""Loss sets: the fixed token rows a held-out loss is measured on, built once and scored at every evaluation.

A set (`eval.sets[i]`) is either a source list like `data.sources` or (`heldout: true`) the held-out share of the
training sources (`data.sources[i].holdout`, data/holdout.py: each record goes to one side by a hash of its
bytes, so no document is in both). Its rows come from the training pipeline itself (tokenizer, packing, chat
rendering and loss masks) read in file order without shuffling, `rows` of `train.seq_len` tokens (0 = the whole
set); every rank builds the same rows, so an evaluation sees the same batches every time and at every layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from data import DataConfig, DataError, GlobalBatchLoader, SourceConfig
from data.holdout import heldout_part
from model.k3 import IGNORE_INDEX, shift_targets
from training.checks import TrainConfigError


class EvalConfigError(TrainConfigError):
    """Bad evaluation input: one line naming the problem and the fix; the run exits 2 before its first step."""


@dataclass
class LossSet:
    """R fixed rows of T tokens with what the loss needs, computed once."""

    name: str
    ids_RT: torch.Tensor  # [R, T] int64
    labels_RT: torch.Tensor  # [R, T] int64, -100 = not a target (HF convention: the model shifts)
    starts: list[list[int]]  # per row its segment starts (first is 0)
    pos_RT: torch.Tensor  # [R, T] int64: position of each token inside its segment (the context it has)
    n_targets: int  # global count of target tokens
    n_bytes: int  # UTF-8 bytes of the target tokens' text (bits per byte)

    @property
    def rows(self) -> int:
        return int(self.ids_RT.shape[0])


def set_sources(spec: dict[str, Any], data_sources: list[SourceConfig]) -> list[SourceConfig]:
    """The sources a set reads: its own list, or the held-out share of the training sources."""
    if spec.get("heldout"):
        held = [heldout_part(s) for s in data_sources if s.holdout > 0]
        if not held:
            raise EvalConfigError(
                f"eval set {spec['name']!r} is the held-out part of data.sources, but no source holds any out: set "
                f"data.sources[i].holdout (e.g. 0.02) or give the set its own sources"
            )
        return held
    return [s if isinstance(s, SourceConfig) else SourceConfig(**s) for s in spec.get("sources") or []]


def build_loss_set(spec: dict[str, Any], data: DataConfig, tokenizer: Any, seq_len: int, loss_on: str) -> LossSet:
    """Read the set's first `rows` rows (all of them for rows=0); EvalConfigError when it has none."""
    sources = set_sources(spec, data.sources)
    if not sources:
        raise EvalConfigError(f"eval set {spec['name']!r} has no sources: give it sources or heldout: true")
    cfg = dataclasses.replace(data, sources=sources, exhaustion="stop", shuffle_buffer=0, num_workers=0)
    want = int(spec.get("rows", 0))
    try:
        loader = GlobalBatchLoader(cfg, tokenizer, seq_len, 1, 1, 0, 1, 0, loss_on=loss_on)
        got = []
        while not want or len(got) < want:
            try:
                got.append(loader.next_microbatch())
            except StopIteration:
                break
    except DataError as e:
        raise EvalConfigError(f"eval set {spec['name']!r}: {e}") from None
    if not got:
        raise EvalConfigError(
            f"eval set {spec['name']!r} yields no row of train.seq_len={seq_len} tokens (its text is shorter than "
            f"one row): give it more text or lower train.seq_len"
        )
    ids_RT = torch.cat([m["input_ids"] for m in got]).long()
    labels_RT = torch.cat([m["labels"] for m in got]).long()
    starts = [[int(s) for s in m["cu_seqlens"][:-1]] for m in got]
    pos_RT = torch.zeros_like(ids_RT)
    n_targets = n_bytes = 0
    T = ids_RT.shape[1]
    for r, st in enumerate(starts):
        bounds = [*st, T]
        cu = torch.tensor(bounds, dtype=torch.int64)
        targets_T = shift_targets(labels_RT[r : r + 1], cu)[0]
        for a, b in zip(bounds[:-1], bounds[1:]):
            pos_RT[r, a:b] = torch.arange(b - a)
            seg = targets_T[a:b]
            seg = seg[seg != IGNORE_INDEX]
            if len(seg):
                n_bytes += len(tokenizer.decode(seg.tolist()).encode("utf-8"))
        n_targets += int((targets_T != IGNORE_INDEX).sum())
    if n_targets == 0:
        raise EvalConfigError(f"eval set {spec['name']!r} has no target tokens (loss_on masks them all): fix its data")
    return LossSet(str(spec["name"]), ids_RT, labels_RT, starts, pos_RT, n_targets, n_bytes)


def position_buckets(seq_len: int, n: int = 4) -> list[tuple[int, int]]:
    """[lo, hi) position buckets, doubling: seq_len 128 -> 0-16, 16-32, 32-64, 64-128."""
    edges = sorted({0, *(max(1, seq_len >> k) for k in range(n - 1, -1, -1))})
    return list(zip(edges[:-1], edges[1:]))
