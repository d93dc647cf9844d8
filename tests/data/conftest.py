"""Small synthetic corpora and one small tokenizer trained on them (session-scoped: trained once)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from data import DataConfig, SourceConfig, train_tokenizer

WORDS = (
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "chi",
    "psi",
    "omega",
    "def",
    "return",
    "class",
    "import",
    "self",
    "value",
    "index",
    "tokens",
    "batch",
    "état",
    "naïve",
    "数据",
    "🙂",
)


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


# -- tiktoken / chat ---------------------------------------------------------------------------------------------
MIXED = [
    "Hello, world! Naïve café — déjà vu.",
    "数据科学和机器学习 中文English混合 北京市 Pascal",
    "def f(x):\n    return x ** 2  # square\n\n\n\tif x:\n\t\tpass",
    "emoji 🙂🚀👍🏽 and 🇫🇷 flags",
    "    four spaces\n\n\n   \t  mixed   whitespace runs   ",
    "1234567890 3.14159 1e-9",
    "こんにちは世界 한국어 текст عربى",
    "a\x00b\x01c",
    "",
]


@pytest.fixture(scope="session")
def chat_rows() -> list[list[dict]]:
    """200 template dialogues (data/examples/make_chat.py)."""
    from data.examples.make_chat import make

    return make(200, seed=3)


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory, chat_rows) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for m in chat_rows:
            f.write(json.dumps({"messages": m}, ensure_ascii=False) + "\n")
    return path


@pytest.fixture(scope="session")
def tiktoken_dir(tmp_path_factory, corpus_dir, chat_file) -> Path:
    """A 1,024-id tokenizer in the K3 release layout, learned on the synthetic corpus + chat contents + MIXED."""
    from data import DataConfig, SourceConfig
    from data.bpe import build_tiktoken_dir

    d = tmp_path_factory.mktemp("tiktoken")
    write_jsonl(d.parent / "mixed.jsonl", MIXED[:-1] * 20)
    cfg = DataConfig(
        sources=[
            SourceConfig(type="jsonl", path=str(corpus_dir / "big.jsonl")),
            SourceConfig(type="jsonl", path=str(chat_file), format="chat"),
            SourceConfig(type="jsonl", path=str(d.parent / "mixed.jsonl")),
        ]
    )
    build_tiktoken_dir(d / "tok", 1024, cfg, max_chars=200_000)
    return d / "tok"


@pytest.fixture(scope="session")
def tik(tiktoken_dir):
    from data import load_tokenizer

    return load_tokenizer(tiktoken_dir)


class _Helpers:
    MIXED = MIXED
    make_docs = staticmethod(make_docs)
    write_jsonl = staticmethod(write_jsonl)
    jsonl_cfg = staticmethod(jsonl_cfg)


@pytest.fixture(scope="session")
def h() -> _Helpers:
    """Corpus helpers (tests import nothing from conftest: pytest runs with --import-mode=importlib)."""
    return _Helpers()
