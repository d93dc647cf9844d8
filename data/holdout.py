"""The held-out share of a source: each record goes to training or to evaluation by a hash of its own bytes.

`SourceConfig.holdout = h` (0 <= h < 1) splits a source in two by construction: a record is held out when the
first 8 bytes of blake2b(record) read as an integer fall below h * 2**64. The decision is a pure function of the
record, so no record can be on both sides (identical duplicates go to the same side), whatever the shuffle,
the seed, the world size or the position in the file; `part: train` streams the records outside the share (what
training reads) and `part: heldout` only those (an evaluation set, training/eval/sets.py). The record is the raw
line for line-based sources (jsonl, json, text, embedded: the embedded corpus' line holds the section's path and
text) and its canonical JSON otherwise (parquet, hub).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from data.config import SourceConfig

_SCALE = float(1 << 64)


LINE_BASED = ("jsonl", "json", "text", "embedded")  # read as raw lines (data/sources.py)


def record_bytes(src: SourceConfig, record: Any) -> bytes:
    """The bytes a record's side is decided by: a line-based source's raw line, else its canonical JSON."""
    if src.type in LINE_BASED:
        return record["text"].encode("latin-1")  # the line as read (decoded as latin-1: one char per byte)
    return json.dumps(record, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8", "surrogatepass")


def is_heldout(data: bytes, share: float) -> bool:
    """True when a record with these bytes belongs to the held-out share `share` of its source."""
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return h < share * _SCALE


def keeps(src: SourceConfig, record: Any) -> bool:
    """Whether the stream of `src` (its `part`) serves this record."""
    if src.holdout <= 0:
        return src.part == "train"
    return is_heldout(record_bytes(src, record), src.holdout) == (src.part == "heldout")


def whole_source(src: SourceConfig) -> SourceConfig:
    """The source with both sides (the tokenizer is trained on all of it)."""
    return dataclasses.replace(src, holdout=0.0, part="train")


def heldout_part(src: SourceConfig) -> SourceConfig:
    """The held-out side of a training source (same records, same order, only those in the share)."""
    return dataclasses.replace(src, part="heldout")
