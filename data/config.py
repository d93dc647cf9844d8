"""DataConfig: everything that decides which token rows the loader produces.

Only OmegaConf-friendly types (str/int/float/bool/Optional/list/nested dataclasses) so the training Hydra config
can embed it as its `data` group. The defaults need no network and no user files: one `embedded` source (the
standard-library corpus, see `data/corpus.py`) and a BPE tokenizer trained on it once and cached.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

SOURCE_TYPES = ("embedded", "jsonl", "json", "text", "parquet", "hub", "synthetic")
SOURCE_FORMATS = ("text", "chat")
TOKENIZER_TYPES = ("auto", "sentencepiece", "tiktoken")
LONG_CONVERSATIONS = ("truncate", "drop")
LOSS_ON = ("assistant", "all")
EXHAUSTION_POLICIES = ("loop", "stop")
PACKING_MODES = ("concat", "pad")
TEXT_SAMPLE_BY = ("line", "paragraph", "document")
HOLDOUT_PARTS = ("train", "heldout")


class DataError(ValueError):
    """Bad data configuration or bad data: always a one-line message naming the problem and the fix."""


@dataclass
class SourceConfig:
    """One source. `path` is a file, a directory, a glob, or (type hub) a hub dataset name."""

    type: str = "embedded"  # embedded | jsonl | json (= JSON Lines) | text | parquet | hub
    path: str = ""  # ignored for embedded
    text_field: str = "text"  # jsonl/json/parquet/hub: the field holding the document
    format: str = "text"  # text: one document per record | chat: record[messages_field] = [{role, content}, ...]
    messages_field: str = "messages"  # chat: the field holding the conversation
    name: Optional[str] = None  # stats/log key (`<name>/skipped_<kind>`); default: the file stem or "embedded"
    weight: float = 1.0  # relative mixing weight (> 0)
    text_sample_by: str = "line"  # text: one document per line | paragraph (blank-line separated) | document (file)
    hub_config: Optional[str] = None  # hub: dataset config name
    split: str = "train"  # hub: split name; synthetic: train | eval (held-out records)
    size: int = 4096  # synthetic: records per epoch (data/synthetic.py draws each one from (split, index))
    holdout: float = 0.0  # share of the records held out of training by a hash of each record (data/holdout.py)
    part: str = "train"  # with holdout > 0: train (the records outside the held-out share) | heldout (only those)


@dataclass
class TokenizerConfig:
    """A tokenizer to load (`model_path`: a file or a checkpoint/tokenizer directory) or the settings to train one.

    `type`: auto (detect from model_path: `tokenizer.model` -> sentencepiece, `tiktoken.model` -> tiktoken; train
    sentencepiece when there is none) | sentencepiece | tiktoken (without model_path: a byte-level BPE in the
    K3 release layout is trained on the sources, cached by content hash like the sentencepiece one).
    """

    type: str = "auto"
    model_path: Optional[str] = None
    vocab_size: int = 4096
    model_type: str = "bpe"  # bpe | unigram
    byte_fallback: bool = True
    character_coverage: float = 0.9995
    pad_piece: str = "<pad>"  # ids: pad 0, unk 1, bos 2, eos 3 (trained models)
    unk_piece: str = "<unk>"
    bos_piece: str = "<s>"
    eos_piece: str = "</s>"
    user_defined_symbols: list[str] = field(default_factory=list)
    train_max_lines: int = 2_000_000  # training reads at most this many lines from the sources, in stream order
    train_seed: int = 1234
    num_threads: int = 1  # encode threads (sentencepiece batch encode)


@dataclass
class DataConfig:
    """Sources, mixing, shuffle, packing, tokenizer, robustness and worker settings of the global-batch loader."""

    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    exhaustion: str = "loop"  # loop: an exhausted source restarts (weights hold forever) | stop: the stream ends
    shuffle_buffer: int = 1024  # documents per shuffle window; <= 1 disables shuffling
    packing: str = "concat"  # concat: no padding, documents split across rows | pad: start a doc in a fresh row
    add_bos: bool = False  # prepend bos to every document
    add_eos: bool = True  # append eos to every document (the separator between packed documents)
    max_bad_fraction: float = 0.01  # per source: skipped/read above this (after >= 100 records or an epoch) -> error
    long_conversations: str = "truncate"  # chat: a conversation longer than seq_len is cut to seq_len | dropped
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    cache_dir: Optional[str] = None  # default: $K3_CACHE_DIR or ~/.cache/k3-train
    num_workers: int = 1  # 0: produce batches in the caller; 1: one background prefetch thread
    prefetch: int = 2  # optimizer steps the background thread may run ahead


# Fields that do not change the produced rows: excluded from the fingerprint.
_NON_STREAM_FIELDS = ("cache_dir", "num_workers", "prefetch")
_NON_STREAM_TOKENIZER_FIELDS = ("num_threads", "model_path", "type")  # the tokenizer's own fingerprint decides
_NON_STREAM_SOURCE_FIELDS = ("name",)
# Fields added after v1 are left out of the fingerprint at their default, so older loader states still resume.
_DEFAULT_ONLY = {"long_conversations": "truncate"}
_SOURCE_DEFAULT_ONLY = {"format": "text", "messages_field": "messages", "size": 4096, "holdout": 0.0, "part": "train"}


def coerce_config(cfg: Any) -> DataConfig:
    """Accept a DataConfig, an OmegaConf DictConfig or a plain dict (e.g. from Hydra) and validate it."""
    if not isinstance(cfg, DataConfig):
        if type(cfg).__name__ == "DictConfig":
            from omegaconf import OmegaConf

            cfg = OmegaConf.to_container(cfg, resolve=True)
        if not isinstance(cfg, dict):
            raise DataError(f"data config must be a DataConfig or a mapping, got {type(cfg).__name__}")
        cfg = _from_dict(cfg)
    validate(cfg)
    return cfg


def _from_dict(d: dict) -> DataConfig:
    d = dict(d)
    known = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise DataError(f"unknown data config key(s) {unknown}: valid keys are {sorted(known)}")
    srcs = d.pop("sources", None)
    tok = d.pop("tokenizer", None)
    out = DataConfig(**d)
    if srcs is not None:
        out.sources = [s if isinstance(s, SourceConfig) else SourceConfig(**s) for s in srcs]
    if tok is not None:
        out.tokenizer = tok if isinstance(tok, TokenizerConfig) else TokenizerConfig(**tok)
    return out


def validate(cfg: DataConfig) -> None:
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise DataError(msg)

    need(len(cfg.sources) > 0, "data.sources is empty: configure at least one source (default: type: embedded)")
    for i, s in enumerate(cfg.sources):
        need(s.type in SOURCE_TYPES, f"data.sources[{i}].type={s.type!r} is not one of {SOURCE_TYPES}")
        need(
            s.type == "embedded" or bool(s.path), f"data.sources[{i}].path is empty: set a file, dir, glob or hub name"
        )
        need(s.weight > 0, f"data.sources[{i}].weight={s.weight} must be > 0")
        need(
            s.text_sample_by in TEXT_SAMPLE_BY,
            f"data.sources[{i}].text_sample_by={s.text_sample_by!r} not in {TEXT_SAMPLE_BY}",
        )
        need(
            s.type != "synthetic" or (s.format == ("text" if s.path == "passkey" else "chat") and s.size >= 1),
            f"data.sources[{i}] type synthetic is image-caption chat (path passkey: text): set that format and "
            f"size >= 1",
        )
        need(
            0.0 <= s.holdout < 1.0 and s.part in HOLDOUT_PARTS,
            f"data.sources[{i}].holdout={s.holdout} must be in [0, 1) and part={s.part!r} one of {HOLDOUT_PARTS}",
        )
        need(s.format in SOURCE_FORMATS, f"data.sources[{i}].format={s.format!r} is not one of {SOURCE_FORMATS}")
        need(
            s.format == "text" or s.type not in ("embedded", "text"),
            f"data.sources[{i}].format=chat needs records with a messages field: use type jsonl, json, parquet "
            f"or hub (type {s.type} holds plain text)",
        )
    names = source_names(cfg)
    need(len(set(names)) == len(names), f"data.sources names {names} are not unique: set data.sources[i].name")
    need(
        cfg.exhaustion in EXHAUSTION_POLICIES, f"data.exhaustion={cfg.exhaustion!r} is not one of {EXHAUSTION_POLICIES}"
    )
    need(cfg.packing in PACKING_MODES, f"data.packing={cfg.packing!r} is not one of {PACKING_MODES}")
    need(
        cfg.long_conversations in LONG_CONVERSATIONS,
        f"data.long_conversations={cfg.long_conversations!r} is not one of {LONG_CONVERSATIONS}",
    )
    need(cfg.shuffle_buffer >= 0, f"data.shuffle_buffer={cfg.shuffle_buffer} must be >= 0")
    need(0.0 <= cfg.max_bad_fraction <= 1.0, f"data.max_bad_fraction={cfg.max_bad_fraction} must be in [0, 1]")
    need(cfg.num_workers in (0, 1), f"data.num_workers={cfg.num_workers} must be 0 (inline) or 1 (background thread)")
    need(cfg.prefetch >= 1, f"data.prefetch={cfg.prefetch} must be >= 1")
    t = cfg.tokenizer
    need(t.type in TOKENIZER_TYPES, f"data.tokenizer.type={t.type!r} is not one of {TOKENIZER_TYPES}")
    need(t.model_type in ("bpe", "unigram"), f"data.tokenizer.model_type={t.model_type!r} must be bpe or unigram")
    need(t.vocab_size >= 64, f"data.tokenizer.vocab_size={t.vocab_size} is too small (>= 64)")
    need(
        t.type != "tiktoken" or t.model_path or t.vocab_size >= 512,
        f"data.tokenizer.vocab_size={t.vocab_size} is too small for a tiktoken tokenizer in the K3 layout (>= 512: "
        f"256 bytes + 256 special tokens)",
    )
    need(t.num_threads >= 1, f"data.tokenizer.num_threads={t.num_threads} must be >= 1")


def source_names(cfg: DataConfig) -> list[str]:
    """Stats/log name of every source: `name`, else the file stem (`embedded` for the stdlib corpus)."""
    out = []
    for i, s in enumerate(cfg.sources):
        if s.name:
            out.append(s.name)
            continue
        parts = [p for p in Path(s.path).parts if not glob.has_magic(p) and p != "/"]  # a glob: its directory
        stem = "embedded" if s.type == "embedded" else re.sub(r"[^A-Za-z0-9_-]", "_", (parts or [""])[-1].split(".")[0])
        stem = stem or f"s{i}"
        out.append(stem if stem not in out else f"{stem}{i}")
    return out


def cache_dir(cfg: Optional[DataConfig] = None) -> Path:
    """cfg.cache_dir, else $K3_CACHE_DIR, else ~/.cache/k3-train (created)."""
    raw = (cfg.cache_dir if cfg is not None else None) or os.environ.get("K3_CACHE_DIR") or "~/.cache/k3-train"
    path = Path(raw).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def stream_dict(cfg: DataConfig) -> dict:
    """The part of the config that decides the produced rows (worker/cache settings removed)."""
    d = dataclasses.asdict(cfg)
    for k in _NON_STREAM_FIELDS:
        d.pop(k)
    for k in _NON_STREAM_TOKENIZER_FIELDS:
        d["tokenizer"].pop(k)
    for k, v in _DEFAULT_ONLY.items():
        if d[k] == v:
            d.pop(k)
    for s in d["sources"]:
        for k in _NON_STREAM_SOURCE_FIELDS:
            s.pop(k)
        for k, v in _SOURCE_DEFAULT_ONLY.items():
            if s[k] == v:
                s.pop(k)
    return d


def digest(obj: Any, n: int = 16) -> str:
    """Short sha256 of a JSON-able object (canonical key order)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def file_digest(path: str | Path, n: int = 16) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:n]
