"""Weighted mixing of sources and the windowed shuffle: the document order, a function of (config, seed) only.

Mixing: before every document a seeded generator picks source i with probability w_i / sum(w); the document is the
next valid one of that source. Exhaustion (`data.exhaustion`):
- `loop` (default): a source that runs out restarts from its first record (its `epoch` counter increases) and the
  draw continues there, so the mixture keeps the configured proportions forever and the stream never ends;
  small sources are repeated more often than large ones (oversampling).
- `stop`: the stream ends the first time the drawn source runs out (like `interleave_datasets`'s
  "first_exhausted"); the loader then drops the incomplete last step and stops iterating.

Shuffle (`data.shuffle_buffer` = W): the mixed stream is cut into windows of W documents and each window is
permuted by a generator seeded with (seed, window index). A document thus moves by less than W positions. Unlike a
reservoir buffer, whose contents would have to be saved, this is exactly resumable from a small state: the
position of the window start (mixer + source states), re-reading at most one window.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from data.config import DataConfig, source_names
from data.sources import SKIP_REASONS, SourceStream

_MIX_SALT = 0x6D6978  # "mix"
_SHUFFLE_SALT = 0x736866  # "shf"
_UNSHUFFLED_WINDOW = 256  # documents tokenized per batch when shuffling is off
Doc = Union[str, list, object]  # a text document, a chat conversation's segments, or a ChatDoc (with images)


class DocumentMixer:
    """Endless (loop) or finite (stop) weighted interleaving of the source streams."""

    def __init__(self, cfg: DataConfig, seed: int, renderer=None, report: bool = True, images=None):
        self.names = source_names(cfg)
        self.streams = [
            SourceStream(s, i, cfg.max_bad_fraction, renderer, report, self.names[i], images)
            for i, s in enumerate(cfg.sources)
        ]
        w = np.array([s.weight for s in cfg.sources], dtype=np.float64)
        self.cum_weights = np.cumsum(w / w.sum())
        self.loop = cfg.exhaustion == "loop"
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _MIX_SALT])))
        self.docs = [0] * len(self.streams)  # documents served per source
        self.ended = False

    def state_dict(self) -> dict:
        return {
            "rng": self.rng.bit_generator.state,
            "docs": list(self.docs),
            "ended": self.ended,
            "sources": [s.state_dict() for s in self.streams],
        }

    def load_state_dict(self, st: dict) -> None:
        self.rng.bit_generator.state = st["rng"]
        self.docs, self.ended = list(st["docs"]), st["ended"]
        for s, ss in zip(self.streams, st["sources"]):
            s.load_state_dict(ss)

    def next_doc(self) -> Optional[Doc]:
        if self.ended:
            return None
        i = 0
        if len(self.streams) > 1:
            i = min(int(np.searchsorted(self.cum_weights, self.rng.random(), side="right")), len(self.streams) - 1)
        stream = self.streams[i]
        text = stream.next_doc()
        if text is None:
            if not self.loop:
                stream.new_epoch()  # still raises on a source without any usable document
                self.ended = True
                return None
            stream.new_epoch()
            text = stream.next_doc()
            if text is None:  # cannot happen after a successful epoch, but never spin
                raise RuntimeError(f"data.{stream.name} yielded nothing after a restart")
        self.docs[i] += 1
        return text

    def stats(self) -> dict:
        skipped = {r: sum(s.skipped.get(r, 0) for s in self.streams) for r in SKIP_REASONS}
        per_source = {
            f"{name}/skipped_{r}": s.skipped[r] for name, s in zip(self.names, self.streams) for r in s.reasons
        }
        return {
            "records_read": sum(s.total_read for s in self.streams),
            "skipped": skipped,
            "skipped_total": sum(skipped.values()),
            "source_docs": list(self.docs),
            "source_epochs": [s.epoch for s in self.streams],
            **per_source,
        }


class ShuffledWindows:
    """The mixed stream in windows of W documents, each permuted by (seed, window index)."""

    def __init__(self, mixer: DocumentMixer, shuffle_buffer: int, seed: int):
        self.mixer, self.seed = mixer, seed
        self.shuffle = shuffle_buffer > 1
        self.size = shuffle_buffer if self.shuffle else _UNSHUFFLED_WINDOW
        self.index = 0  # next window to read

    def state_dict(self) -> dict:
        """Where the next window starts (its anchor): enough to re-read it exactly."""
        return {"window": self.index, "mixer": self.mixer.state_dict()}

    def load_state_dict(self, anchor: dict) -> None:
        self.index = anchor["window"]
        self.mixer.load_state_dict(anchor["mixer"])

    def read(self) -> Optional[tuple[dict, list[Doc]]]:
        """(anchor of this window, its documents in shuffled order), or None when the stream has ended."""
        anchor = self.state_dict()
        docs: list[Doc] = []
        while len(docs) < self.size:
            text = self.mixer.next_doc()
            if text is None:
                break
            docs.append(text)
        if not docs:
            return None
        if self.shuffle:
            perm = np.random.default_rng([self.seed, _SHUFFLE_SALT, self.index]).permutation(len(docs))
            docs = [docs[k] for k in perm]
        self.index += 1
        return anchor, docs
