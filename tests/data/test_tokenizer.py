"""Tokenizer: lossless round trip, special ids, save/load, training determinism, caching, CLI."""

from __future__ import annotations

import pytest

from data import DataError, Tokenizer, prepare_tokenizer, train_tokenizer
from data.tokenizer import main as tokenizer_cli

TEXTS = [
    "def f(x):\n    return x  # naïve état 数据 🙂\n\n\tdone",
    "  leading and trailing  ",
    "a\r\nb",
    "ü" * 3,
    "unseen glyphs: ∮ ⊕ 𝔘 ✈",
    "x",
]


def test_decode_encode_round_trip_is_lossless(small_tokenizer):
    for text in TEXTS:
        assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


def test_encode_batch_equals_single_encodes(small_tokenizer):
    small_tokenizer.num_threads = 2
    try:
        assert small_tokenizer.encode_batch(TEXTS) == [small_tokenizer.encode(t) for t in TEXTS]
    finally:
        small_tokenizer.num_threads = 1


def test_trained_special_ids_and_vocab_size(small_tokenizer):
    t = small_tokenizer
    assert (t.pad_id, t.bos_id, t.eos_id, t.vocab_size) == (0, 2, 3, 400)
    assert t.sp.id_to_piece(t.eos_id) == "</s>"


def test_save_then_load_gives_identical_ids(small_tokenizer, tmp_path):
    path = small_tokenizer.save(tmp_path / "ckpt")
    loaded = Tokenizer.load(tmp_path / "ckpt")  # a directory holding tokenizer.model
    assert path.name == "tokenizer.model" and loaded.fingerprint == small_tokenizer.fingerprint
    assert loaded.encode_batch(TEXTS) == small_tokenizer.encode_batch(TEXTS)


def test_training_is_deterministic(h, corpus_dir, small_tokenizer, tmp_path):
    cfg = h.jsonl_cfg((corpus_dir / "big.jsonl", 1.0))
    cfg.tokenizer.vocab_size = 400
    again = train_tokenizer(cfg, tmp_path / "again.model")
    assert again.model_proto == small_tokenizer.model_proto


def test_prepare_tokenizer_trains_once_then_loads_from_cache(h, corpus_dir, tmp_path):
    cfg = h.jsonl_cfg((corpus_dir / "small.jsonl", 1.0), cache_dir=str(tmp_path))
    cfg.tokenizer.vocab_size = 300
    first = prepare_tokenizer(cfg)
    mtime = (tmp_path / first.path).stat().st_mtime_ns
    second = prepare_tokenizer(cfg)
    assert second.path == first.path and (tmp_path / first.path).stat().st_mtime_ns == mtime
    assert second.model_proto == first.model_proto


def test_prepare_tokenizer_loads_configured_model_path(h, small_tokenizer, corpus_dir):
    cfg = h.jsonl_cfg((corpus_dir / "big.jsonl", 1.0))
    cfg.tokenizer.model_path = small_tokenizer.path
    assert prepare_tokenizer(cfg).fingerprint == small_tokenizer.fingerprint


def test_missing_model_path_is_a_one_line_error(tmp_path):
    with pytest.raises(DataError, match="nope.model.*not found") as e:
        Tokenizer.load(tmp_path / "nope.model")
    assert "\n" not in str(e.value)


def test_vocab_too_large_for_corpus_is_a_one_line_error(h, corpus_dir, tmp_path):
    cfg = h.jsonl_cfg((corpus_dir / "small.jsonl", 1.0))
    cfg.tokenizer.vocab_size = 50_000
    with pytest.raises(DataError, match="vocab_size") as e:
        train_tokenizer(cfg, tmp_path / "t.model")
    assert "\n" not in str(e.value)


def test_cli_train_writes_a_loadable_model(corpus_dir, tmp_path, capsys):
    out = tmp_path / "cli.model"
    tokenizer_cli(
        [
            "train",
            "--out",
            str(out),
            "--vocab-size",
            "300",
            "--source-type",
            "jsonl",
            "--source-path",
            str(corpus_dir / "small.jsonl"),
        ]
    )
    assert "vocab 300" in capsys.readouterr().out
    assert Tokenizer.load(out).vocab_size == 300
