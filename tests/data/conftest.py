"""Small synthetic corpora and one small tokenizer trained on them (session-scoped: trained once)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from data import DataConfig, SourceConfig, train_tokenizer

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega def return class import self value index tokens batch "
         "état naïve 数据 🙂").split()


def make_docs(n: int, seed: int, prefix: str = "d", max_words: int = 60) -> list[str]:
    """n documents with a unique first word (prefix+index) and 1..max_words random words (some multi-line)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [f"{prefix}{i}"] + [rng.choice(WORDS) for _ in range(rng.randint(0, max_words))]
        if rng.random() < 0.3:
            words.insert(len(words) // 2, "\n   ")
        docs.append(" ".join(words))
    return docs


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d}, ensure_ascii=False) + "\n")
    return path


def jsonl_cfg(*paths_weights, **kw) -> DataConfig:
    """DataConfig over jsonl files [(path, weight), ...]."""
    srcs = [SourceConfig(type="jsonl", path=str(p), weight=w) for p, w in paths_weights]
    kw.setdefault("shuffle_buffer", 16)
    kw.setdefault("num_workers", 0)
    return DataConfig(sources=srcs, **kw)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    write_jsonl(d / "big.jsonl", make_docs(300, 1, "big"))
    write_jsonl(d / "small.jsonl", make_docs(7, 2, "small"))
    return d


@pytest.fixture(scope="session")
def small_tokenizer(corpus_dir, tmp_path_factory):
    cfg = jsonl_cfg((corpus_dir / "big.jsonl", 1.0))
    cfg.tokenizer.vocab_size = 400
    return train_tokenizer(cfg, tmp_path_factory.mktemp("tok") / "tok.model")


class _Helpers:
    make_docs = staticmethod(make_docs)
    write_jsonl = staticmethod(write_jsonl)
    jsonl_cfg = staticmethod(jsonl_cfg)


@pytest.fixture(scope="session")
def h() -> _Helpers:
    """Corpus helpers (tests import nothing from conftest: pytest runs with --import-mode=importlib)."""
    return _Helpers()
