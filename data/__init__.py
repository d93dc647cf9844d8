"""Streaming data pipeline: sources -> weighted mix -> windowed shuffle -> tokenize -> pack -> global batches.

Public API (see data/README.md for the semantics: layout invariance, resume, exhaustion, bad input):
- `DataConfig`, `SourceConfig`, `TokenizerConfig`, `DataError`
- `Tokenizer` (the interface; `Tokenizer.load(dir_or_file)` detects sentencepiece | tiktoken),
  `load_tokenizer(dir_or_file)`, `train_tokenizer(cfg, out_path)`, `prepare_tokenizer(cfg)`
- `GlobalBatchLoader(cfg, tokenizer, seq_len, global_batch_size, micro_batch_size, rank, world_size, seed,
  loss_on="assistant")`
- `atomic_write(path, data)` (data/files.py), `cache_dir(cfg)` (data/config.py)
- `default_corpus_path()` (the embedded standard-library corpus)
Submodules are imported lazily, so `python -m data.tokenizer` runs cleanly and `from data import DataConfig` is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from data.config import DataConfig, DataError, SourceConfig, TokenizerConfig, cache_dir
from data.files import atomic_write

_LAZY = {
    "Tokenizer": "data.tokenizer",
    "load_tokenizer": "data.tokenizer",
    "train_tokenizer": "data.tokenizer",
    "prepare_tokenizer": "data.tokenizer",
    "GlobalBatchLoader": "data.loader",
    "default_corpus_path": "data.corpus",
}

__all__ = ["DataConfig", "DataError", "SourceConfig", "TokenizerConfig", "atomic_write", "cache_dir", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
