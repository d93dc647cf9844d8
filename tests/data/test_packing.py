"""Packing: every token exactly once and in order, boundaries (cu_seqlens), labels, padding, efficiency.

Reference: the documents of the corpus in file order (no shuffle, exhaustion stop), tokenized one by one and
concatenated with eos, cut by a plain list-based loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data import GlobalBatchLoader

T = 32


def reference_docs(h, tok, n=300) -> list[list[int]]:
    return [tok.encode(d) + [tok.eos_id] for d in h.make_docs(n, 1, "big")]


def all_batches(loader) -> list[dict]:
    return list(loader)


def flat(batches, key="input_ids") -> list[int]:
    return torch.cat([b[key].reshape(-1) for b in batches]).tolist()


def reference_pad_rows(docs: list[list[int]], pad: int) -> list[tuple[list[int], int]]:
    """(row tokens, valid length) by the obvious greedy loop: a doc that fits a fresh row never splits."""
    rows, cur = [], []
    for doc in docs:
        if cur and len(doc) <= T and len(cur) + len(doc) > T:
            rows.append((cur + [pad] * (T - len(cur)), len(cur)))
            cur = []
        for t in doc:
            cur.append(t)
            if len(cur) == T:
                rows.append((cur, T))
                cur = []
    return rows


@pytest.fixture
def stop_cfg(h, corpus_dir):
    return h.jsonl_cfg((corpus_dir / "big.jsonl", 1.0), shuffle_buffer=0, exhaustion="stop")


def test_concat_rows_are_the_token_stream_no_token_lost_or_duplicated(h, stop_cfg, small_tokenizer):
    batches = all_batches(GlobalBatchLoader(stop_cfg, small_tokenizer, T, 4, 2))
    stream = [t for d in reference_docs(h, small_tokenizer) for t in d]
    got = flat(batches)
    assert len(got) == len(stream) // (4 * T) * (4 * T)  # only the incomplete last step is dropped
    assert got == stream[: len(got)]


def test_cu_seqlens_mark_every_row_start_and_document_start(h, stop_cfg, small_tokenizer):
    b = 2
    batches = all_batches(GlobalBatchLoader(stop_cfg, small_tokenizer, T, 4, b))
    lengths = [len(d) for d in reference_docs(h, small_tokenizer)]
    doc_starts = set(np.cumsum([0] + lengths[:-1]).tolist())
    for k, batch in enumerate(batches):
        base = k * b * T
        expected = sorted({i * T for i in range(b)} | {s - base for s in doc_starts if base <= s < base + b * T})
        assert batch["cu_seqlens"].dtype == torch.int32
        assert batch["cu_seqlens"].tolist() == expected + [b * T]


def test_labels_equal_inputs_except_ignored_at_segment_starts(stop_cfg, small_tokenizer):
    for batch in all_batches(GlobalBatchLoader(stop_cfg, small_tokenizer, T, 4, 2)):
        ids, labels, cu = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1), batch["cu_seqlens"]
        ignored = torch.zeros_like(ids, dtype=torch.bool)
        ignored[cu[:-1].long()] = True
        assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
        assert torch.equal(labels[~ignored], ids[~ignored]) and bool((labels[ignored] == -100).all())
        assert batch["num_tokens"] == ids.numel()


def test_pad_mode_matches_greedy_reference_and_never_splits_short_docs(h, stop_cfg, small_tokenizer):
    stop_cfg.packing = "pad"
    loader = GlobalBatchLoader(stop_cfg, small_tokenizer, T, 4, 4)
    batches = all_batches(loader)
    ref = reference_pad_rows(reference_docs(h, small_tokenizer), small_tokenizer.pad_id)
    rows = [r for b in batches for r in b["input_ids"].tolist()]
    assert rows == [r for r, _ in ref[: len(rows)]]
    valid = sum(n for _, n in ref[: len(rows)])
    assert sum(b["num_tokens"] for b in batches) == valid
    assert loader.stats()["packing_efficiency"] == pytest.approx(valid / (len(rows) * T))
    assert 0.5 < loader.stats()["packing_efficiency"] < 1.0


def test_pad_mode_padding_is_ignored_and_its_own_segment(stop_cfg, small_tokenizer):
    stop_cfg.packing = "pad"
    for batch in all_batches(GlobalBatchLoader(stop_cfg, small_tokenizer, T, 4, 4)):
        for i in range(4):
            row_ids, row_labels = batch["input_ids"][i], batch["labels"][i]
            n = int((row_ids != small_tokenizer.pad_id).sum())  # pad id never occurs in text
            assert bool((row_labels[n:] == -100).all())
            if n < T:
                assert i * T + n in batch["cu_seqlens"].tolist()


def test_bos_is_prepended_to_every_document_when_configured(h, stop_cfg, small_tokenizer):
    stop_cfg.add_bos = True
    got = flat(all_batches(GlobalBatchLoader(stop_cfg, small_tokenizer, T, 4, 4)))
    stream = [t for d in reference_docs(h, small_tokenizer) for t in [small_tokenizer.bos_id] + d]
    assert got == stream[: len(got)] and len(got) > 0
