"""The embedded default corpus: the Python standard library's own sources (code, comments, docstrings).

Every Python installation has it, so the smoke run trains on real text with no network and no user files. Built
once into `<cache>/corpus/stdlib-<python version>-v<builder version>.jsonl` (one JSON object per line:
`{"text": <a top-level section of a module>, "path": <posix path relative to the stdlib root>[#i]}`), then reused.

Deterministic: files are taken from `sysconfig.get_paths()["stdlib"]` in sorted posix-path order with a fixed
filter (only `*.py`; no `site-packages`/`dist-packages`, no test directories, no generated `encodings/` tables,
no file that is not UTF-8 or is shorter than 64 characters). The result therefore depends on the CPython version
(and on distro packaging that may leave modules out); its sha256 is part of the loader's data fingerprint, so a
checkpoint resumed on a machine with a different corpus is detected. CPython 3.11.7: 606 modules cut into 1,729
section documents, 10.7 MB of text, 3.27 M tokens with the default 4096-piece tokenizer.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from data.config import cache_dir
from data.files import atomic_open

BUILDER_VERSION = 2  # v2: modules split into top-level sections (finer shuffling)
_EXCLUDED_TOP = {"site-packages", "dist-packages", "encodings"}
_EXCLUDED_ANY = {"test", "tests", "idle_test", "__pycache__"}
_MIN_CHARS = 64
_SECTION_CHARS = 2000  # sections are merged up to at least this many characters


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_documents(root: Optional[Path] = None):
    """Yield (relative posix path, text) for every corpus document, in a machine-independent order."""
    root = root or stdlib_root()
    rels = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        parts = rel_dir.parts
        if (parts and parts[0] in _EXCLUDED_TOP) or any(p in _EXCLUDED_ANY for p in parts):
            dirnames[:] = []
            continue
        rels.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    for rel in sorted(rels):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text.strip()) >= _MIN_CHARS:
            yield rel, text


def split_sections(text: str, min_chars: int = _SECTION_CHARS) -> list[str]:
    """Cut a module at its top-level section breaks (two blank lines, PEP 8) into pieces of >= min_chars.

    Whole modules run to hundreds of KB (one pydoc table is 0.7 MB); as single documents a short run sees a few
    modules for many consecutive steps and its loss follows them. Sections shuffle into a steady mix. The pieces
    concatenate back to the module exactly.
    """
    parts = text.split("\n\n\n")
    pieces: list[str] = []
    cur = ""
    for i, part in enumerate(parts):
        cur += part + ("\n\n\n" if i < len(parts) - 1 else "")
        if len(cur) >= min_chars:
            pieces.append(cur)
            cur = ""
    if cur:
        if pieces and len(cur) < min_chars:
            pieces[-1] += cur
        else:
            pieces.append(cur)
    return pieces


def default_corpus_path(cache: Optional[Path] = None) -> Path:
    """Path of the cached stdlib corpus (jsonl), building it first if needed (atomic: safe with many ranks)."""
    version = ".".join(map(str, sys.version_info[:3]))
    out = Path(cache or cache_dir()) / "corpus" / f"stdlib-{version}-v{BUILDER_VERSION}.jsonl"
    if out.is_file():
        return out
    with atomic_open(out, "w") as f:
        for rel, text in iter_stdlib_documents():
            for i, piece in enumerate(split_sections(text)):
                path = rel if i == 0 else f"{rel}#{i}"
                f.write(json.dumps({"text": piece, "path": path}, ensure_ascii=False) + "\n")
    return out


def heldout_corpus_path(share: float, cache: Optional[Path] = None) -> Path:
    """The records of the stdlib corpus in its held-out share `share` (data/holdout.py), cached beside it: an
    evaluation set reads these few lines instead of scanning the whole corpus (the same records, same order)."""
    from data.holdout import is_heldout

    full = default_corpus_path(cache)
    out = full.with_name(f"{full.stem}-heldout-{share:g}.jsonl")
    if out.is_file():
        return out
    with open(full, "rb") as src, atomic_open(out, "w") as f:
        for raw in src:
            line = raw.rstrip(b"\n")
            if line and is_heldout(line, share):
                f.write(line.decode("utf-8") + "\n")
    return out
