"""Sentencepiece tokenizer: train (streaming from the configured sources), load, batch-encode, decode, save.

Trained models are lossless on any text: identity normalisation, no dummy prefix, whitespace kept (runs of spaces
may be pieces, useful for code), byte fallback for everything outside the vocabulary. Special ids of trained
models: pad 0, unk 1, bos 2, eos 3. `prepare_tokenizer(cfg)` loads `cfg.tokenizer.model_path` or trains one and
caches it under `<cache>/tokenizers/<hash of sources + settings>.model`, so every rank and every later run reuses
the identical file; `Tokenizer.save(dir)` copies it beside a checkpoint so a run stays reproducible.

CLI: `python -m data.tokenizer train --out tok.model [--vocab-size N] [--source-type jsonl --source-path PATH
[--text-field F]]` (no source: the embedded standard-library corpus); `python -m data.tokenizer encode
--model tok.model TEXT`.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import sentencepiece as spm

from data.config import DataConfig, DataError, SourceConfig, cache_dir, coerce_config, digest

_MAX_LINE_CHARS = 4096  # sentencepiece drops longer training sentences; longer lines are cut into pieces


class Tokenizer:
    """A loaded sentencepiece model (thin wrapper: batch encode, decode, ids of special tokens, save)."""

    def __init__(self, model_proto: bytes, path: Optional[str] = None, num_threads: int = 1):
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto, self.path, self.num_threads = model_proto, path, num_threads
        self.fingerprint = hashlib.sha256(model_proto).hexdigest()[:16]

    @classmethod
    def load(cls, path: str | os.PathLike, num_threads: int = 1) -> "Tokenizer":
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "tokenizer.model"
        if not p.is_file():
            raise DataError(f"tokenizer model {str(path)!r} not found: set data.tokenizer.model_path to a .model file")
        return cls(p.read_bytes(), str(p), num_threads)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def _id(self, i: int) -> Optional[int]:
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

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Batch encode (sentencepiece's multi-threaded path when num_threads > 1)."""
        return self.sp.encode(list(texts), out_type=int, num_threads=self.num_threads)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `<directory>/tokenizer.model` (the exact bytes this tokenizer was loaded from)."""
        out = Path(directory) / "tokenizer.model"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(self.model_proto)
        return out


def _training_lines(cfg: DataConfig) -> Iterator[str]:
    """Non-empty lines of one epoch of every source; source i contributes at most its weight share of the cap."""
    from data.sources import SourceStream

    total_w = sum(s.weight for s in cfg.sources)
    for i, src in enumerate(cfg.sources):
        budget = int(cfg.tokenizer.train_max_lines * src.weight / total_w)
        stream = SourceStream(src, i, cfg.max_bad_fraction)
        while budget > 0:
            doc = stream.next_doc()
            if doc is None:
                break
            for line in doc.split("\n"):
                for k in range(0, len(line), _MAX_LINE_CHARS):
                    piece = line[k:k + _MAX_LINE_CHARS]
                    if piece.strip() and budget > 0:
                        budget -= 1
                        yield piece


def train_tokenizer(cfg: DataConfig, out_path: str | os.PathLike) -> Tokenizer:
    """Train a sentencepiece model on the configured sources (streamed) and write it to `out_path` atomically."""
    cfg = coerce_config(cfg)
    t = cfg.tokenizer
    out = Path(out_path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = _training_lines(cfg)
    first = next(lines, None)
    if first is None:
        raise DataError("tokenizer training found no text in data.sources: configure a source with documents")

    def all_lines():
        yield first
        yield from lines

    spm.set_random_generator_seed(t.train_seed)
    proto = _ProtoWriter()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_lines(), model_writer=proto, model_type=t.model_type, vocab_size=t.vocab_size,
            byte_fallback=t.byte_fallback, character_coverage=t.character_coverage,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, max_sentence_length=4 * _MAX_LINE_CHARS + 16,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3, pad_piece=t.pad_piece, unk_piece=t.unk_piece,
            bos_piece=t.bos_piece, eos_piece=t.eos_piece, user_defined_symbols=list(t.user_defined_symbols),
            input_sentence_size=0, num_threads=1, minloglevel=2, hard_vocab_limit=True)
    except RuntimeError as e:
        raise DataError(f"sentencepiece training failed: {str(e).splitlines()[-1]} (e.g. lower "
                        f"data.tokenizer.vocab_size={t.vocab_size} for a small corpus)") from e
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-tok-")
    with os.fdopen(fd, "wb") as f:
        f.write(proto.data)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared
    os.replace(tmp, out)
    return Tokenizer(proto.data, str(out), t.num_threads)


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
    return digest({"tokenizer": d["tokenizer"], "sources": d["sources"], "data": ids,
                   "max_bad_fraction": cfg.max_bad_fraction, "spm": spm.__version__})


def prepare_tokenizer(cfg) -> Tokenizer:
    """Load `cfg.tokenizer.model_path`, or train (once, cached by content hash) the configured default."""
    cfg = coerce_config(cfg)
    t = cfg.tokenizer
    if t.model_path:
        return Tokenizer.load(t.model_path, t.num_threads)
    path = cache_dir(cfg) / "tokenizers" / f"{t.model_type}{t.vocab_size}-{tokenizer_cache_key(cfg)}.model"
    if path.is_file():
        return Tokenizer.load(path, t.num_threads)
    return train_tokenizer(cfg, path)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m data.tokenizer", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train a sentencepiece model on a source (default: the embedded corpus)")
    tr.add_argument("--out", required=True)
    tr.add_argument("--vocab-size", type=int, default=4096)
    tr.add_argument("--model-type", default="bpe")
    tr.add_argument("--source-type", default="embedded")
    tr.add_argument("--source-path", default="")
    tr.add_argument("--text-field", default="text")
    tr.add_argument("--max-lines", type=int, default=2_000_000)
    en = sub.add_parser("encode", help="print the ids of TEXT")
    en.add_argument("--model", required=True)
    en.add_argument("text")
    a = p.parse_args(argv)
    if a.cmd == "train":
        cfg = DataConfig(sources=[SourceConfig(type=a.source_type, path=a.source_path, text_field=a.text_field)])
        cfg.tokenizer.vocab_size, cfg.tokenizer.model_type = a.vocab_size, a.model_type
        cfg.tokenizer.train_max_lines = a.max_lines
        tok = train_tokenizer(cfg, a.out)
        print(f"wrote {a.out}: vocab {tok.vocab_size}, sha256 {tok.fingerprint}")
    else:
        print(Tokenizer.load(a.model).encode(a.text))


if __name__ == "__main__":
    main()
