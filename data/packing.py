"""Packing tokenized documents into fixed-length rows, and rows into model batches.

Every document is `[bos]? tokens [eos]?` (eos is the separator between packed documents). Modes:
- `concat`: the token stream is cut into rows of exactly `seq_len`; a document may continue in the next row.
  No padding (packing efficiency 1.0).
- `pad`: a document that would fit in an empty row but not in the rest of the current one starts a fresh row; the
  rest is padding (label -100). Documents longer than a row are split as in `concat`.

A row starts a new segment at position 0 and at every document start (and at the padding), so a micro-batch
flattened row-major to [1, b*T] carries `cu_seqlens` with a boundary at every row start and document start: KDA
resets its state/conv there and MLA uses block-diagonal causal masks. The position of the next row is the small
`pointer()`: (window anchor, document index in the shuffled window, token offset) plus counters.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from data.mixing import ShuffledWindows

IGNORE_INDEX = -100
_ENCODE_BATCH = 32  # documents per tokenizer call


@dataclass
class Row:
    tokens: np.ndarray  # [T] int32 (padding = pad id)
    starts: list[int]  # segment starts inside the row, first is 0, increasing
    n_valid: int  # tokens before the padding


class Packer:
    """Turns the shuffled document windows into rows; exactly restorable from `pointer()`."""

    def __init__(self, windows: ShuffledWindows, encode: Callable[[list[str]], list[list[int]]], seq_len: int,
                 mode: str, bos_id: Optional[int], eos_id: Optional[int], pad_id: int):
        self.windows, self.encode, self.seq_len, self.mode = windows, encode, seq_len, mode
        self.prefix = [bos_id] if bos_id is not None else []
        self.suffix = [eos_id] if eos_id is not None else []
        self.pad_id = pad_id
        self.anchor: Optional[dict] = None  # window the next token comes from (None: stream start)
        self.texts: Optional[list[str]] = None  # the current shuffled window
        self.docs: dict[int, np.ndarray] = {}  # tokenized documents of the window (a small batch at a time)
        self.j = 0  # document index in the window
        self.o = 0  # token offset in that document
        self.ended = False
        self.counters = {"rows": 0, "tokens": 0, "padding": 0, "documents": 0}

    # -- position -----------------------------------------------------------------------------------------------
    def pointer(self) -> dict:
        return {"anchor": copy.deepcopy(self.anchor), "doc": self.j, "offset": self.o, **self.counters}

    def restore(self, ptr: dict) -> None:
        self.counters = {k: int(ptr[k]) for k in self.counters}
        self.anchor, self.texts, self.docs, self.j, self.o = None, None, {}, 0, 0
        if ptr["anchor"] is not None:
            self.windows.seek(ptr["anchor"])
            self._load_window()
            self.j, self.o = ptr["doc"], ptr["offset"]

    # -- documents ----------------------------------------------------------------------------------------------
    def _load_window(self) -> bool:
        got = self.windows.read()
        if got is None:
            self.ended = True
            return False
        self.anchor, self.texts = got
        self.docs = {}
        self.j = self.o = 0
        return True

    def _doc(self, j: int) -> np.ndarray:
        """Tokens of window document j; tokenized lazily in small batches so a restore re-encodes little."""
        if j not in self.docs:
            texts = self.texts[j:j + _ENCODE_BATCH]
            self.docs = {j + k: np.asarray(self.prefix + ids + self.suffix, dtype=np.int32)
                         for k, ids in enumerate(self.encode(texts))}
        return self.docs[j]

    def _current(self) -> Optional[np.ndarray]:
        """The document holding the next token (skipping documents with nothing to pack), None at the end."""
        while True:
            if self.texts is None or self.j >= len(self.texts):
                if self.ended or not self._load_window():
                    return None
                continue
            doc = self._doc(self.j)
            if len(doc):
                return doc
            self.j, self.o = self.j + 1, 0

    # -- rows ---------------------------------------------------------------------------------------------------
    def next_row(self) -> Optional[Row]:
        """The next row, or None when the stream ended before the row could be filled."""
        T = self.seq_len
        row = np.full(T, self.pad_id, dtype=np.int32)
        starts: list[int] = []
        fill = 0
        while fill < T:
            doc = self._current()
            if doc is None:
                return None
            rem = len(doc) - self.o
            if self.mode == "pad" and self.o == 0 and fill > 0 and T - fill < rem <= T:
                break  # fits a fresh row: pad this one
            if self.o == 0:
                starts.append(fill)
                self.counters["documents"] += 1
            elif fill == 0:
                starts.append(0)  # a row start inside a document
            take = min(T - fill, rem)
            row[fill:fill + take] = doc[self.o:self.o + take]
            fill += take
            self.o += take
            if self.o == len(doc):
                self.j, self.o = self.j + 1, 0
        if fill < T:
            starts.append(fill)  # the padding is its own segment
        self.counters["rows"] += 1
        self.counters["tokens"] += fill
        self.counters["padding"] += T - fill
        return Row(row, starts, fill)


def collate(rows: list[Row]) -> dict:
    """Rows -> {input_ids [b,T] int64, labels [b,T] int64, cu_seqlens [n+1] int32, num_tokens int}.

    Labels follow the HF convention (the model shifts: position t predicts labels[t+1]); they equal input_ids
    except -100 on padding and at every segment start (that label would be the target of the previous segment's
    last token, which is never a loss target).
    """
    b, T = len(rows), len(rows[0].tokens)
    ids_BT = torch.from_numpy(np.stack([r.tokens for r in rows]).astype(np.int64))  # [b, T]
    labels_BT = ids_BT.clone()
    bounds = []
    for i, r in enumerate(rows):
        labels_BT[i, r.n_valid:] = IGNORE_INDEX
        labels_BT[i, r.starts] = IGNORE_INDEX
        bounds.extend(i * T + s for s in r.starts)
    bounds.append(b * T)
    return {"input_ids": ids_BT, "labels": labels_BT, "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
            "num_tokens": int(sum(r.n_valid for r in rows))}
