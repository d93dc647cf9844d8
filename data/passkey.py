"""Passkey documents: a key hidden in filler text, asked for at the end (the long-context retrieval probe).

One home for the text format, shared by the evaluation task (training/eval/passkey.py, which fills a document to an
exact token length) and the synthetic training source `{type: synthetic, path: passkey, format: text}` of
`experiment=passkey_smoke` (record i of a split is a function of (split, i): resume is exact):

    Find the pass key.
    The grass is green. The sky is blue. ... The pass key is 48213. Remember it. ... There and back again.
    What is the pass key? The pass key is 48213

A training record asks the question `repeats` times (each answered): the later answers can be copied from the
earlier ones a few tokens back, a short-range copy that a tiny model learns within a few hundred steps and that is
the same look-back-and-copy the first answer needs over the haystack (bench/passkey_probe.py: with one question,
2-digit keys stay at chance for 400 steps; with three they are retrieved by step ~250). The evaluation's documents
ask once: the key appears once before the question, drawn at random per row.
"""

from __future__ import annotations

import random

from data.synthetic import IndexedRecords

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
INTRO = "Find the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
_SPLIT_SALT = {"train": 0x706B74, "eval": 0x706B65}


def document(key: str, n_filler: int, depth: float) -> str:
    """The haystack with `n_filler` filler sentences and the needle after round(depth * n_filler) of them, ending in
    the question (the answer, " " + key, is not part of it)."""
    at = round(depth * n_filler)
    fill = [FILLER[i % len(FILLER)] for i in range(n_filler)]
    needle = f"The pass key is {key}. Remember it."
    return INTRO + " ".join([*fill[:at], needle, *fill[at:]]) + QUESTION


def random_key(rng: random.Random, digits: int = 5) -> str:
    return "".join(rng.choice("0123456789") for _ in range(digits))


def record(index: int, split: str = "train", max_filler: int = 3, digits: int = 2, repeats: int = 3) -> dict:
    """Training record `index`: a random key of `digits` digits, depth and filler count (0..max_filler), the
    question asked and answered `repeats` times."""
    rng = random.Random(_SPLIT_SALT[split] * 1_000_003 + index)
    key = random_key(rng, digits)
    doc = document(key, rng.randint(0, max_filler), rng.random())
    return {"text": doc + (" " + key + QUESTION) * (repeats - 1) + " " + key}


class PasskeyDocs(IndexedRecords):
    """One epoch of `size` passkey records as a source (data/synthetic.py IndexedRecords: exact resume)."""

    def __init__(self, split: str, size: int) -> None:
        if split not in _SPLIT_SALT:
            raise ValueError(f"synthetic passkey split {split!r} is not one of {sorted(_SPLIT_SALT)}")
        super().__init__(record, split, size)
