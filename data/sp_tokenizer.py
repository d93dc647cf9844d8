"""Sentencepiece tokenizer: train (streaming from the configured sources), load, batch-encode, decode, save.

Trained models are lossless on any text: identity normalisation, no dummy prefix, whitespace kept (runs of spaces
may be pieces, useful for code), byte fallback for everything outside the vocabulary. Special ids of trained
models: pad 0, unk 1, bos 2, eos 3. `prepare_sentencepiece(cfg)` trains one once and caches it under
`<cache>/tokenizers/<hash of sources + settings>.model`, so every rank and every later run reuses the identical
file; `save(dir)` copies it beside a checkpoint so a run stays reproducible.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Optional, Union

import sentencepiece as spm

from data.config import DataConfig, DataError, cache_dir, coerce_config, digest, source_names
from data.files import atomic_write
from data.holdout import whole_source
from data.tokenizer_base import KINDS, AllowedSpecial, Tokenizer

_MAX_LINE_CHARS = 4096  # sentencepiece drops longer training sentences; longer lines are cut into pieces


class SentencePieceTokenizer(Tokenizer):
    """A loaded sentencepiece model (batch encode, decode, ids of special pieces, save)."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, path: Optional[str] = None, num_threads: int = 1):
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto, self.path, self.num_threads = model_proto, path, num_threads
        self.fingerprint = hashlib.sha256(model_proto).hexdigest()[:16]
        # control pieces (pad/bos/eos) and unk; user-defined symbols are ordinary (always atomic) pieces here
        self._special = {
            self.sp.id_to_piece(i): i
            for i in range(self.sp.get_piece_size())
            if self.sp.is_control(i) or self.sp.is_unknown(i)
        }
        tpl = Path(path).with_name("chat_template.jinja") if path else None
        self.chat_template = tpl.read_text(encoding="utf-8") if tpl is not None and tpl.is_file() else None

    @classmethod
    def load(cls, path: Union[str, os.PathLike], num_threads: int = 1) -> SentencePieceTokenizer:
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "tokenizer.model"
        if not p.is_file():
            raise DataError(f"tokenizer model {str(path)!r} not found: set data.tokenizer.model_path to a .model file")
        return cls(p.read_bytes(), str(p), num_threads)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @staticmethod
    def _id(i: int) -> Optional[int]:
        return i if i >= 0 else None

    @property
    def bos_id(self) -> Optional[int]:
        return self._id(self.sp.bos_id())

    @property
    def eos_id(self) -> Optional[int]:
        return self._id(self.sp.eos_id())

    @property
    def pad_id(self) -> Optional[int]:
        return self._id(self.sp.pad_id())

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._special)

    def encode(self, text: str, allowed_special: AllowedSpecial = frozenset()) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Batch encode (sentencepiece's multi-threaded path when num_threads > 1)."""
        return self.sp.encode(list(texts), out_type=int, num_threads=self.num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def save(self, directory: Union[str, os.PathLike]) -> Path:
        """Write `<directory>/tokenizer.model` (the exact bytes this tokenizer was loaded from)."""
        out = atomic_write(Path(directory) / "tokenizer.model", self.model_proto)
        if self.chat_template is not None:
            atomic_write(Path(directory) / "chat_template.jinja", self.chat_template)
        return out


def training_texts(cfg: DataConfig, max_items: int) -> Iterator[str]:
    """Documents of one epoch of every source, source i contributing at most its weight share of `max_items`.

    A conversation (chat source) is its K3 rendering with the markers removed, so the format's own words
    (`message`, ` role`, `response`) get merges too. Raises the source's own DataError (bad data) as is. A
    source's held-out share (`holdout`, data/holdout.py) is read too: one tokenizer for both sides."""
    from data.chat import K3Renderer
    from data.sources import SourceStream

    k3 = K3Renderer()

    total_w = sum(s.weight for s in cfg.sources)
    names = source_names(cfg)
    for i, src in enumerate(cfg.sources):
        budget = int(max_items * src.weight / total_w)
        stream = SourceStream(whole_source(src), i, cfg.max_bad_fraction, label=names[i])
        while budget > 0:
            doc = stream.next_doc()
            if doc is None:
                stream.check_usable()
                break
            if isinstance(doc, list):
                doc = "".join("\n" if control else text for text, control, _ in k3.render(doc))
            budget -= 1
            yield doc


def _training_lines(cfg: DataConfig) -> Iterator[str]:
    """Non-empty lines (cut to sentencepiece's sentence limit) of the training texts."""
    budget = cfg.tokenizer.train_max_lines
    for doc in training_texts(cfg, cfg.tokenizer.train_max_lines):
        for line in doc.split("\n"):
            for k in range(0, len(line), _MAX_LINE_CHARS):
                piece = line[k : k + _MAX_LINE_CHARS]
                if piece.strip() and budget > 0:
                    budget -= 1
                    yield piece


def train_sentencepiece(cfg: DataConfig, out_path: Union[str, os.PathLike]) -> SentencePieceTokenizer:
    """Train a sentencepiece model on the configured sources (streamed) and write it to `out_path` atomically."""
    cfg = coerce_config(cfg)
    t = cfg.tokenizer
    out = Path(out_path).expanduser()
    lines = _training_lines(cfg)
    first = next(lines, None)
    if first is None:
        raise DataError("tokenizer training found no text in data.sources: configure a source with documents")
    failure: list[BaseException] = []

    def all_lines():
        # sentencepiece swallows exceptions raised inside the iterator: keep bad-data errors to re-raise them
        try:
            yield first
            yield from lines
        except DataError as e:
            failure.append(e)

    spm.set_random_generator_seed(t.train_seed)
    proto = _ProtoWriter()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_lines(),
            model_writer=proto,
            model_type=t.model_type,
            vocab_size=t.vocab_size,
            byte_fallback=t.byte_fallback,
            character_coverage=t.character_coverage,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=4 * _MAX_LINE_CHARS + 16,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            pad_piece=t.pad_piece,
            unk_piece=t.unk_piece,
            bos_piece=t.bos_piece,
            eos_piece=t.eos_piece,
            user_defined_symbols=list(t.user_defined_symbols),
            input_sentence_size=0,
            num_threads=1,
            minloglevel=2,
            hard_vocab_limit=True,
        )
    except RuntimeError as e:
        if failure:
            raise failure[0] from None
        raise DataError(
            f"sentencepiece training failed: {str(e).splitlines()[-1].strip()} (e.g. lower "
            f"data.tokenizer.vocab_size={t.vocab_size} for a small corpus)"
        ) from e
    if failure:
        raise failure[0]
    atomic_write(out, proto.data)
    return SentencePieceTokenizer(proto.data, str(out), t.num_threads)


KINDS["sentencepiece"] = SentencePieceTokenizer


class _ProtoWriter:
    def __init__(self):
        self.data = b""

    def write(self, b: bytes) -> int:
        self.data += b
        return len(b)


def tokenizer_cache_key(cfg: DataConfig) -> str:
    """Hash of what decides a trained model: the settings and the identity of the source data."""
    from data.config import stream_dict
    from data.sources import resolve_files, source_identity

    ids = [source_identity(s, resolve_files(s, i)) for i, s in enumerate(cfg.sources)]
    d = stream_dict(cfg)
    for s in d["sources"]:  # the tokenizer reads the whole source, whatever its held-out share
        s.pop("holdout", None), s.pop("part", None)
    return digest(
        {
            "tokenizer": d["tokenizer"],
            "sources": d["sources"],
            "data": ids,
            "max_bad_fraction": cfg.max_bad_fraction,
            "spm": spm.__version__,
        }
    )


def prepare_sentencepiece(cfg: DataConfig) -> SentencePieceTokenizer:
    """The configured sentencepiece model, trained once and cached by content hash."""
    t = cfg.tokenizer
    path = cache_dir(cfg) / "tokenizers" / f"{t.model_type}{t.vocab_size}-{tokenizer_cache_key(cfg)}.model"
    if path.is_file():
        return SentencePieceTokenizer.load(path, t.num_threads)
    return train_sentencepiece(cfg, path)
