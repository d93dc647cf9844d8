"""Embedded default corpus: deterministic selection from the standard library, cached, valid JSON Lines."""

from __future__ import annotations

import json

from data import corpus


def make_fake_stdlib(root):
    files = {
        "b.py": "x = 1\n" * 20,
        "a.py": '"""Docstring."""\n' * 10,
        "pkg/__init__.py": "",
        "pkg/mod.py": "def f():\n    return 'é'\n" * 5,
        "test/test_a.py": "assert 1\n" * 30,
        "pkg/tests/t.py": "assert 2\n" * 30,
        "site-packages/numpy/x.py": "import os\n" * 20,
        "encodings/cp1.py": "table = 1\n" * 20,
        "latin.py": None,
        "notes.txt": "not python " * 20,
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x = '\xe9'\n" * 20 if text is None else text.encode())


def test_documents_are_filtered_and_sorted(tmp_path):
    make_fake_stdlib(tmp_path)
    assert [rel for rel, _ in corpus.iter_stdlib_documents(tmp_path)] == ["a.py", "b.py", "pkg/mod.py"]


def test_corpus_build_is_deterministic_and_cached(tmp_path, monkeypatch):
    make_fake_stdlib(tmp_path / "lib")
    monkeypatch.setattr(corpus, "stdlib_root", lambda: tmp_path / "lib")
    first = corpus.default_corpus_path(tmp_path / "c1")
    second = corpus.default_corpus_path(tmp_path / "c2")
    assert first.read_bytes() == second.read_bytes()
    records = [json.loads(line) for line in first.read_text().splitlines()]
    assert [r["path"] for r in records] == ["a.py", "b.py", "pkg/mod.py"]
    assert records[2]["text"] == "def f():\n    return 'é'\n" * 5
    mtime = first.stat().st_mtime_ns
    assert corpus.default_corpus_path(tmp_path / "c1").stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_real_stdlib_corpus_has_hundreds_of_python_modules():
    docs = corpus.iter_stdlib_documents()
    first = [next(docs) for _ in range(300)]
    assert len({rel for rel, _ in first}) == 300
    assert all(rel.endswith(".py") and "test" not in rel.split("/")[:-1] for rel, _ in first)


def test_sections_reassemble_the_module_exactly_and_respect_the_minimum_size():
    text = "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(200)) + "x = 1\n"
    pieces = corpus.split_sections(text, min_chars=300)
    assert "".join(pieces) == text
    assert len(pieces) > 1 and all(len(p) >= 300 for p in pieces)
