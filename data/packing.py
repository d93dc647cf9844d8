"""Packing tokenized documents into fixed-length rows, and rows into model batches.

A text document is `[bos]? tokens [eos]?` (eos is the separator between packed documents); a chat conversation
is `[bos]? rendered conversation` (its turns already end with the format's end-of-message token) and carries a
loss mask (data/chat.py). Modes (`data.packing`, for text documents):
- `concat`: the token stream is cut into rows of exactly `seq_len`; a document may continue in the next row.
  No padding (packing efficiency 1.0).
- `pad`: a document that would fit in an empty row but not in the rest of the current one starts a fresh row; the
  rest is padding (label -100). Documents longer than a row are split as in `concat`.
A conversation is never split across rows (whatever the mode): one that does not fit the rest of the current row
starts a fresh row, and one longer than `seq_len` is cut to `seq_len` (`data.long_conversations=truncate`) or
dropped (`drop`); both are counted.

A row starts a new segment at position 0 and at every document start (and at the padding), so a micro-batch
flattened row-major to [1, b*T] carries `cu_seqlens` with a boundary at every row start and document start: KDA
resets its state/conv there and MLA uses block-diagonal causal masks. The position of the next row is the small
`state_dict()`: (window anchor, document index in the shuffled window, token offset) plus counters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from data.chat import ChatDoc, encode_conversations
from data.config import DataError
from data.images import MEDIA_BEGIN, MEDIA_END, PreparedImage, batch_images
from data.mixing import ShuffledWindows

IGNORE_INDEX = -100
_ENCODE_BATCH = 32  # documents per tokenizer call
_MAX_DROPPED_IN_A_ROW = 1000  # consecutive dropped conversations: the data cannot fill rows (never spin forever)
_COUNTERS = (
    "rows",
    "tokens",
    "padding",
    "documents",
    "loss_tokens",
    "conversations",
    "conversations_truncated",
    "conversations_dropped",
    "images",
    "image_tokens",
)


@dataclass
class Row:
    tokens: np.ndarray  # [T] int32 (padding = pad id)
    starts: list[int]  # segment starts inside the row, first is 0, increasing
    n_valid: int  # tokens before the padding
    loss: Optional[np.ndarray] = None  # [T] bool: token is a loss target (None: every valid token)
    images: list[PreparedImage] = field(default_factory=list)  # the row's images, in placeholder order


@dataclass
class _Doc:
    ids: np.ndarray  # [n] int32
    loss: np.ndarray  # [n] bool
    chat: bool
    status: str = ""  # chat: "" | "truncated" | "dropped"
    images: list[PreparedImage] = field(default_factory=list)  # whole image blocks inside `ids`, in order


class Packer:
    """Turns the shuffled document windows into rows; exactly restorable from `state_dict()`."""

    def __init__(
        self,
        windows: ShuffledWindows,
        tokenizer,
        seq_len: int,
        mode: str,
        bos_id: Optional[int],
        eos_id: Optional[int],
        pad_id: int,
        loss_on: str = "assistant",
        long_conversations: str = "truncate",
    ):
        self.windows, self.tokenizer, self.seq_len, self.mode = windows, tokenizer, seq_len, mode
        self.prefix = [bos_id] if bos_id is not None else []
        self.suffix = [eos_id] if eos_id is not None else []
        self.pad_id, self.loss_on, self.long_conversations = pad_id, loss_on, long_conversations
        self.anchor: Optional[dict] = None  # window the next token comes from (None: stream start)
        self.texts: Optional[list] = None  # the current shuffled window (str or chat segments)
        self.docs: dict[int, _Doc] = {}  # tokenized documents of the window (a small batch at a time)
        self.j = 0  # document index in the window
        self.o = 0  # token offset in that document
        self.ended = False
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._dropped_in_a_row = 0

    # -- position -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"anchor": copy.deepcopy(self.anchor), "doc": self.j, "offset": self.o, **self.counters}

    def load_state_dict(self, ptr: dict) -> None:
        self.counters = {k: int(ptr.get(k, 0)) for k in self.counters}
        self.anchor, self.texts, self.docs, self.j, self.o = None, None, {}, 0, 0
        if ptr["anchor"] is not None:
            self.windows.load_state_dict(ptr["anchor"])
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

    def _encode(self, items: list) -> list[_Doc]:
        """Tokenize a batch of documents (texts in one encode_batch call, conversations in another)."""
        texts = [(k, d) for k, d in enumerate(items) if isinstance(d, str)]
        convs = [(k, d) for k, d in enumerate(items) if not isinstance(d, str)]
        out: list[Optional[_Doc]] = [None] * len(items)
        for (k, _), ids in zip(texts, self.tokenizer.encode_batch([d for _, d in texts]) if texts else []):
            arr = np.asarray(self.prefix + ids + self.suffix, dtype=np.int32)
            out[k] = _Doc(arr, np.ones(len(arr), dtype=bool), False)
        segs = [d.segments if isinstance(d, ChatDoc) else d for _, d in convs]
        for (k, d), (ids, loss) in zip(
            convs, encode_conversations(self.tokenizer, segs, self.loss_on) if convs else []
        ):
            if self.prefix:
                ids = np.concatenate([np.asarray(self.prefix, np.int32), ids])
                loss = np.concatenate([np.asarray([self.loss_on == "all"]), loss])
            images = list(d.images) if isinstance(d, ChatDoc) else []
            doc = _Doc(ids, loss, True, images=images)
            if len(ids) > self.seq_len:
                if self.long_conversations == "drop":
                    doc = _Doc(ids[:0], loss[:0], True, "dropped")
                else:
                    cut, kept = self._cut(ids, images)
                    doc = _Doc(ids[:cut], loss[:cut], True, "truncated", images[:kept])
            out[k] = doc
        return out  # type: ignore[return-value]

    def _cut(self, ids: np.ndarray, images: list[PreparedImage]) -> tuple[int, int]:
        """(tokens kept, images kept) of a conversation cut to seq_len: never inside an image block, so a cut
        that would fall in one ends the conversation before its `<|media_begin|>`."""
        if not images:
            return self.seq_len, 0
        begins = np.flatnonzero(ids == self.tokenizer.token_to_id(MEDIA_BEGIN))
        ends = np.flatnonzero(ids == self.tokenizer.token_to_id(MEDIA_END))
        kept = int((ends < self.seq_len).sum())
        return (int(begins[kept]) if kept < len(images) else self.seq_len), kept

    def _doc(self, j: int) -> _Doc:
        """Window document j; tokenized lazily in small batches so a restore re-encodes little."""
        if j not in self.docs:
            self.docs = {j + k: d for k, d in enumerate(self._encode(self.texts[j : j + _ENCODE_BATCH]))}
        return self.docs[j]

    def _current(self) -> Optional[_Doc]:
        """The document holding the next token (skipping documents with nothing to pack), None at the end."""
        while True:
            if self.texts is None or self.j >= len(self.texts):
                if self.ended or not self._load_window():
                    return None
                continue
            doc = self._doc(self.j)
            if len(doc.ids):
                self._dropped_in_a_row = 0
                return doc
            if doc.status == "dropped":
                self.counters["conversations_dropped"] += 1
                self._dropped_in_a_row += 1
                if self._dropped_in_a_row >= _MAX_DROPPED_IN_A_ROW:
                    raise DataError(
                        f"{self._dropped_in_a_row} conversations in a row are longer than seq_len="
                        f"{self.seq_len} and were dropped (data.long_conversations=drop): raise "
                        f"train.seq_len or set data.long_conversations=truncate"
                    )
            self.j, self.o = self.j + 1, 0

    # -- rows ---------------------------------------------------------------------------------------------------
    def next_row(self) -> Optional[Row]:
        """The next row, or None when the stream ended before the row could be filled."""
        T = self.seq_len
        row = np.full(T, self.pad_id, dtype=np.int32)
        loss = np.zeros(T, dtype=bool)
        starts: list[int] = []
        images: list[PreparedImage] = []
        fill = 0
        c = self.counters
        while fill < T:
            doc = self._current()
            if doc is None:
                return None
            rem = len(doc.ids) - self.o
            if self.o == 0 and fill > 0 and T - fill < rem and (doc.chat or (self.mode == "pad" and rem <= T)):
                break  # fits a fresh row (conversations always do): pad this one
            if self.o == 0:
                starts.append(fill)
                c["documents"] += 1
                if doc.chat:
                    c["conversations"] += 1
                    c["conversations_truncated"] += doc.status == "truncated"
                    images += doc.images  # a conversation is whole in its row: so are its image blocks
                    c["images"] += len(doc.images)
                    c["image_tokens"] += sum(im.num_tokens for im in doc.images)
            elif fill == 0:
                starts.append(0)  # a row start inside a document
            take = min(T - fill, rem)
            row[fill : fill + take] = doc.ids[self.o : self.o + take]
            loss[fill : fill + take] = doc.loss[self.o : self.o + take]
            fill += take
            self.o += take
            if self.o == len(doc.ids):
                self.j, self.o = self.j + 1, 0
        if fill < T:
            starts.append(fill)  # the padding is its own segment
        loss[starts] = False  # a segment's first token is never a target (see collate)
        c["rows"] += 1
        c["tokens"] += fill
        c["padding"] += T - fill
        c["loss_tokens"] += int(loss.sum())
        return Row(row, starts, fill, loss, images)


def collate(rows: list[Row]) -> dict:
    """Rows -> {input_ids [b,T] int64, labels [b,T] int64, cu_seqlens [n+1] int32, num_tokens int}, plus
    pixel_values [N, 3, p, p] float32 and grid_thws [n, 3] int64 when the rows hold images (row-major order, the
    order the model scatters features into the `<|media_pad|>` positions of the flattened rows).

    Labels follow the HF convention (the model shifts: position t predicts labels[t+1]); they equal input_ids
    where the token is a loss target and -100 elsewhere: on padding, at every segment start (that label would be
    the target of the previous segment's last token, which is never a loss target), and on the non-learned part
    of conversations (prompts, under loss_on=assistant).
    """
    b, T = len(rows), len(rows[0].tokens)
    ids_BT = torch.from_numpy(np.stack([r.tokens for r in rows]).astype(np.int64))  # [b, T]
    labels_BT = ids_BT.clone()
    bounds = []
    for i, r in enumerate(rows):
        if r.loss is not None:
            labels_BT[i, torch.from_numpy(~r.loss)] = IGNORE_INDEX
        labels_BT[i, r.n_valid :] = IGNORE_INDEX
        labels_BT[i, r.starts] = IGNORE_INDEX
        bounds.extend(i * T + s for s in r.starts)
    bounds.append(b * T)
    out = {
        "input_ids": ids_BT,
        "labels": labels_BT,
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "num_tokens": int(sum(r.n_valid for r in rows)),
    }
    images = [im for r in rows for im in r.images]
    if images:
        pixels, grids = batch_images(images)
        out["pixel_values"], out["grid_thws"] = torch.from_numpy(pixels), torch.from_numpy(grids)
    return out
