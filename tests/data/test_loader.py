"""GlobalBatchLoader: determinism, layout-invariant sharding, exact resume, fingerprint, validation, stats."""

from __future__ import annotations

import json
import time

import pytest
import torch

from data import DataError, GlobalBatchLoader

T = 24


@pytest.fixture
def cfg(h, corpus_dir):
    """Two sources (a 7-document one loops often), shuffle windows of 16 documents, background thread."""
    return h.jsonl_cfg((corpus_dir / "big.jsonl", 3.0), (corpus_dir / "small.jsonl", 1.0), num_workers=1)


def make(cfg, tok, G=8, b=2, rank=0, W=1, seed=0):
    return GlobalBatchLoader(cfg, tok, T, G, b, rank, W, seed)


def take(loader, n: int) -> list[dict]:
    return [loader.next_microbatch() for _ in range(n)]


def global_rows(cfg, tok, steps: int, G=8, b=2, W=1, seed=0) -> list[torch.Tensor]:
    """Per step, the global batch [G, T] assembled from all W simulated ranks (rank order, micro order)."""
    per_rank = []
    for r in range(W):
        loader = make(cfg, tok, G, b, r, W, seed)
        batches = take(loader, steps * loader.grad_accum)
        loader.close()
        per_rank.append(batches)
    out = []
    for s in range(steps):
        parts = [mb["input_ids"] for r in range(W) for mb in per_rank[r] if mb["step"] == s]
        out.append(torch.cat(parts))
    return out


def same(a: list[dict], b: list[dict]) -> bool:
    keys = ("input_ids", "labels", "cu_seqlens")
    return len(a) == len(b) and all(
        x["step"] == y["step"] and x["micro"] == y["micro"] and all(torch.equal(x[k], y[k]) for k in keys)
        for x, y in zip(a, b)
    )


def resumed(cfg, tok, state: dict, n: int, **kw) -> tuple[list[dict], dict]:
    loader = make(cfg, tok, **kw)
    loader.load_state_dict(json.loads(json.dumps(state)))  # checkpoints store it as JSON
    got = take(loader, n)
    st = loader.state_dict()
    loader.close()
    return got, st


def test_same_seed_gives_same_batches_and_other_seed_differs(cfg, small_tokenizer):
    a, b, c = (take(make(cfg, small_tokenizer, seed=s), 12) for s in (0, 0, 1))
    assert same(a, b) and not same(a, c)


def test_background_thread_and_inline_produce_identical_batches(cfg, small_tokenizer):
    threaded = take(make(cfg, small_tokenizer), 12)
    cfg.num_workers = 0
    assert same(threaded, take(make(cfg, small_tokenizer), 12))


@pytest.mark.parametrize("W,b", [(2, 2), (4, 1), (2, 1)])
def test_sharding_is_disjoint_complete_and_layout_invariant(cfg, small_tokenizer, W, b):
    reference = global_rows(cfg, small_tokenizer, 3, G=8, b=8, W=1)
    sharded = global_rows(cfg, small_tokenizer, 3, G=8, b=b, W=W)
    assert [torch.equal(x, y) for x, y in zip(sharded, reference)] == [True] * 3


def test_rank_shares_of_a_step_are_fixed_contiguous_blocks(cfg, small_tokenizer):
    full = torch.cat([mb["input_ids"] for mb in take(make(cfg, small_tokenizer, G=8, b=4), 2)])  # step 0
    for r in range(4):
        mine = make(cfg, small_tokenizer, G=8, b=1, rank=r, W=4)
        got = torch.cat([mb["input_ids"] for mb in take(mine, 2)])
        assert torch.equal(got, full[2 * r : 2 * r + 2])


def test_micro_batches_carry_step_and_micro_index(cfg, small_tokenizer):
    loader = make(cfg, small_tokenizer, G=8, b=2, W=2)  # grad_accum 2
    assert [(mb["step"], mb["micro"]) for mb in take(loader, 5)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]


def test_global_batch_not_divisible_is_a_one_line_error(cfg, small_tokenizer):
    with pytest.raises(DataError, match=r"global_batch_size=10 is not a multiple of .*2\*4") as e:
        make(cfg, small_tokenizer, G=10, b=2, W=4)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("n", [1, 3, 4, 11])  # mid-step and step-boundary states
def test_resume_gives_identical_batches(cfg, small_tokenizer, n):
    loader = make(cfg, small_tokenizer, b=2)
    take(loader, n)
    state = loader.state_dict()
    expected = take(loader, 9)
    loader.close()
    got, _ = resumed(cfg, small_tokenizer, state, 9)
    assert same(got, expected)


def test_resume_twice_in_a_row(cfg, small_tokenizer):
    uninterrupted = take(make(cfg, small_tokenizer), 30)
    first = make(cfg, small_tokenizer)
    got = take(first, 7)
    more, st = resumed(cfg, small_tokenizer, first.state_dict(), 9)
    first.close()
    rest, _ = resumed(cfg, small_tokenizer, st, 14)
    assert same(got + more + rest, uninterrupted)


def test_resume_right_after_a_source_looped(cfg, small_tokenizer):
    loader = make(cfg, small_tokenizer, b=8)
    for _ in range(200):
        take(loader, 1)
        if loader.stats()["source_epochs"][1] >= 1:
            break
    assert loader.stats()["source_epochs"][1] >= 1  # the 7-document source has restarted
    state, expected = loader.state_dict(), take(loader, 6)
    loader.close()
    assert same(resumed(cfg, small_tokenizer, state, 6, b=8)[0], expected)


def test_resume_with_shuffle_off_and_single_window_docs(h, corpus_dir, small_tokenizer):
    cfg = h.jsonl_cfg((corpus_dir / "big.jsonl", 1.0), shuffle_buffer=0)
    loader = make(cfg, small_tokenizer)
    take(loader, 5)
    state, expected = loader.state_dict(), take(loader, 5)
    assert same(resumed(cfg, small_tokenizer, state, 5)[0], expected)


def test_shuffle_permutes_documents_within_windows_only(h, corpus_dir, small_tokenizer):
    cfg = h.jsonl_cfg((corpus_dir / "big.jsonl", 1.0), shuffle_buffer=64, exhaustion="stop")
    tokens = torch.cat([mb["input_ids"].reshape(-1) for mb in make(cfg, small_tokenizer, G=4, b=4)]).tolist()
    docs, cur = [], []
    for t in tokens:
        if t == small_tokenizer.eos_id:
            docs.append(int(small_tokenizer.decode(cur).split()[0][len("big") :]))  # documents start "big<i>"
            cur = []
        else:
            cur.append(t)
    assert len(docs) >= 128 and docs[:128] != list(range(128))
    for w in range(len(docs) // 64):
        assert sorted(docs[64 * w : 64 * (w + 1)]) == list(range(64 * w, 64 * (w + 1)))


def test_world_size_change_at_step_boundary_resplits_exactly(cfg, small_tokenizer):
    two = [make(cfg, small_tokenizer, G=8, b=2, rank=r, W=2) for r in range(2)]
    for loader in two:
        take(loader, 2 * 3)  # 3 full steps
    states = [loader.state_dict() for loader in two]
    for loader in two:
        loader.close()
    assert states[0]["pointer"] == states[1]["pointer"] and states[0]["micro_done"] == 0
    got, _ = resumed(cfg, small_tokenizer, states[0], 2, b=4)  # world size 1, 2 micro-batches per step
    expected = global_rows(cfg, small_tokenizer, 4, G=8, b=8, W=1)[3]
    assert torch.equal(torch.cat([mb["input_ids"] for mb in got]), expected)
    assert [mb["step"] for mb in got] == [3, 3]


def test_world_size_change_mid_step_is_a_one_line_error(cfg, small_tokenizer):
    loader = make(cfg, small_tokenizer, G=8, b=2, W=2)
    take(loader, 1)
    state = loader.state_dict()
    loader.close()
    with pytest.raises(DataError, match="micro-batches into step 0") as e:
        make(cfg, small_tokenizer, G=8, b=2, W=1).load_state_dict(state)
    assert "\n" not in str(e.value)


def test_fingerprint_mismatch_is_an_error_unless_not_strict(cfg, small_tokenizer):
    loader = make(cfg, small_tokenizer, seed=0)
    take(loader, 2)
    state = loader.state_dict()
    loader.close()
    other = make(cfg, small_tokenizer, seed=5)
    with pytest.raises(DataError, match="fingerprint.*strict=False") as e:
        other.load_state_dict(state)
    assert "\n" not in str(e.value)
    other.load_state_dict(state, strict=False)
    nxt = other.next_microbatch()
    assert (nxt["step"], nxt["micro"]) == (0, 2)  # continues at the saved position


def test_state_describes_position_after_returned_batches_not_prefetched_ones(cfg, small_tokenizer):
    cfg.prefetch = 4
    loader = make(cfg, small_tokenizer)
    take(loader, 3)
    deadline = time.monotonic() + 30
    while loader._queue.qsize() < 4 and time.monotonic() < deadline:  # let the thread run ahead
        time.sleep(0.01)
    assert loader._queue.qsize() >= 4
    state = loader.state_dict()
    assert (state["step"], state["micro_done"]) == (0, 3)
    expected = take(loader, 3)
    loader.close()
    assert same(resumed(cfg, small_tokenizer, state, 3)[0], expected)


def test_state_is_small_and_json_serializable(cfg, small_tokenizer):
    loader = make(cfg, small_tokenizer)
    take(loader, 5)
    assert len(json.dumps(loader.state_dict())) < 8192


def test_stop_policy_ends_iteration_instead_of_waiting(h, corpus_dir, small_tokenizer):
    cfg = h.jsonl_cfg((corpus_dir / "small.jsonl", 1.0), exhaustion="stop", num_workers=1)
    batches = list(make(cfg, small_tokenizer, G=2, b=2))
    assert 0 < len(batches) < 100
    loader = make(cfg, small_tokenizer, G=2, b=2)
    take(loader, len(batches))
    with pytest.raises(StopIteration):
        loader.next_microbatch()


def test_stats_count_tokens_documents_and_skipped_records_and_survive_resume(h, tmp_path, small_tokenizer):
    docs = h.make_docs(60, 3)
    path = h.write_jsonl(tmp_path / "a.jsonl", docs)
    path.write_text("{broken\n" + path.read_text())
    cfg = h.jsonl_cfg((path, 1.0), max_bad_fraction=0.05)
    loader = make(cfg, small_tokenizer)
    take(loader, 12)
    st = loader.stats()
    assert st["skipped"]["malformed_json"] >= 1 and st["records_read"] >= 17
    assert st["tokens"] == st["rows"] * T == 8 * (st["step"] + 1) * T and st["packing_efficiency"] == 1.0
    assert st["rank_tokens"] == 12 * 2 * T and st["documents"] > 0
    state = loader.state_dict()
    take(loader, 4)
    expected_stats = loader.stats()
    loader.close()
    restored = make(cfg, small_tokenizer)
    restored.load_state_dict(state)
    assert restored.stats() == st
    take(restored, 4)
    assert restored.stats() == expected_stats
