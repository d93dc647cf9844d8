"""Chat sources in the global-batch loader: labels from the loss mask, exact resume, layout invariance, bad rows."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from data import DataConfig, DataError, GlobalBatchLoader, SourceConfig, prepare_tokenizer
from data.config import stream_dict

T = 128


def chat_cfg(chat_file, corpus_dir, only_chat: bool = False, **kw) -> DataConfig:
    """A chat source mixed with a text source (weight 3:1) unless only_chat, shuffled in windows of 16 documents."""
    kw.setdefault("shuffle_buffer", 16)
    kw.setdefault("num_workers", 0)
    srcs = [SourceConfig(type="jsonl", path=str(chat_file), format="chat", weight=3.0)]
    if not only_chat:
        srcs.append(SourceConfig(type="jsonl", path=str(corpus_dir / "big.jsonl"), weight=1.0))
    return DataConfig(sources=srcs, **kw)


def take(loader, n: int) -> list[dict]:
    return [loader.next_microbatch() for _ in range(n)]


def keyed(batches: list[dict]) -> list[tuple]:
    return [
        (b["step"], b["micro"], b["input_ids"].tolist(), b["labels"].tolist(), b["cu_seqlens"].tolist())
        for b in batches
    ]


def test_chat_batches_keep_the_keys_and_labels_are_ids_or_ignore(chat_file, corpus_dir, tik):
    loader = GlobalBatchLoader(chat_cfg(chat_file, corpus_dir), tik, T, 4, 2)
    batches = take(loader, 6)
    assert set(batches[0]) == {"input_ids", "labels", "cu_seqlens", "num_tokens", "step", "micro"}
    targets = 0
    for b in batches:
        lab, ids = b["labels"], b["input_ids"]
        assert torch.equal(lab[lab != -100], ids[lab != -100])
        targets += int((lab != -100).sum())
    st = loader.stats()
    assert st["loss_tokens"] == targets and 0 < st["loss_token_fraction"] < 1
    assert st["loss_token_fraction"] == pytest.approx(targets / st["tokens"])
    assert st["conversations"] > 0 and st["source_docs"][0] > st["source_docs"][1]  # mixed by weight 3:1


def test_assistant_labels_are_the_assistant_turns_and_all_labels_everything(chat_file, corpus_dir, tik):
    cfg = chat_cfg(chat_file, corpus_dir, only_chat=True, shuffle_buffer=0)
    a = take(GlobalBatchLoader(cfg, tik, T, 2, 2, loss_on="assistant"), 3)
    b = take(GlobalBatchLoader(cfg, tik, T, 2, 2, loss_on="all"), 3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    row, lab = a[0]["input_ids"][0], a[0]["labels"][0]
    keep = (lab != -100).numpy()
    runs = np.flatnonzero(np.diff(np.concatenate([[0], keep.astype(np.int8), [0]])))
    tail = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    learned = [tik.decode(row[x:y].tolist()) for x, y in zip(runs[::2], runs[1::2])]
    assert learned and all(t.endswith(tail) and "role=" not in t for t in learned)
    all_lab = b[0]["labels"][0]
    assert int((all_lab != -100).sum()) > int((lab != -100).sum())
    with pytest.raises(DataError, match="loss_on"):
        GlobalBatchLoader(cfg, tik, T, 2, 2, loss_on="prompt")


def test_conversations_never_straddle_rows(chat_file, corpus_dir, tik):
    cfg = chat_cfg(chat_file, corpus_dir, only_chat=True, long_conversations="drop")  # no cut conversation
    eom = tik.token_to_id("<|end_of_msg|>")
    for b in take(GlobalBatchLoader(cfg, tik, T, 4, 4), 3):
        for row in b["input_ids"]:
            valid = row[row != tik.pad_id]
            assert valid[0] == tik.token_to_id("<|open|>") and valid[-1] == eom  # whole conversations only


def test_resume_twice_is_identical_with_chat_sources(chat_file, corpus_dir, tik):
    cfg = chat_cfg(chat_file, corpus_dir, num_workers=1)
    full = take(GlobalBatchLoader(cfg, tik, T, 4, 2), 16)
    first = GlobalBatchLoader(cfg, tik, T, 4, 2)
    head = take(first, 5)  # mid-step
    st1 = json.loads(json.dumps(first.state_dict()))
    first.close()
    second = GlobalBatchLoader(cfg, tik, T, 4, 2)
    second.load_state_dict(st1)
    middle = take(second, 6)
    st2 = json.loads(json.dumps(second.state_dict()))
    second.close()
    third = GlobalBatchLoader(cfg, tik, T, 4, 2)
    third.load_state_dict(st2)
    tail = take(third, 5)
    third.close()
    assert keyed(head + middle + tail) == keyed(full)


def global_batches(cfg, tok, steps: int, W: int, b: int, G: int = 4) -> list[tuple[list, list]]:
    per_rank = []
    for r in range(W):
        loader = GlobalBatchLoader(cfg, tok, T, G, b, r, W)
        per_rank.append(take(loader, steps * loader.grad_accum))
    out = []
    for s in range(steps):
        mbs = [mb for r in range(W) for mb in per_rank[r] if mb["step"] == s]
        out.append((torch.cat([m["input_ids"] for m in mbs]).tolist(), torch.cat([m["labels"] for m in mbs]).tolist()))
    return out


def test_dp2_ga1_and_dp1_ga2_see_the_same_global_rows_with_chat_sources(chat_file, corpus_dir, tik):
    cfg = chat_cfg(chat_file, corpus_dir)
    dp2 = global_batches(cfg, tik, 4, W=2, b=2)  # G=4: 2 ranks x 1 micro-batch of 2
    ga2 = global_batches(cfg, tik, 4, W=1, b=2)  # 1 rank x 2 micro-batches of 2
    assert dp2 == ga2 and len(dp2) == 4


def write_bad_chat(path, rows) -> dict:
    bad = {
        "no_messages": [{"text": "x"}, {"messages": []}],
        "bad_message": [{"messages": [{"role": "user"}]}, {"messages": [{"content": "hi"}]}],
        "unknown_role": [{"messages": [{"role": "wizard", "content": "hi"}]}],
    }
    lines = [json.dumps({"messages": m}) for m in rows]
    for i, rec in enumerate(r for rs in bad.values() for r in rs):
        lines.insert(5 + 9 * i, json.dumps(rec))
    lines.insert(3, "{not json")
    path.write_text("\n".join(lines) + "\n")
    return {**{k: len(v) for k, v in bad.items()}, "malformed_json": 1}


def test_bad_rows_are_skipped_counted_per_source_and_reported_once_per_kind(tmp_path, chat_rows, tik, caplog):
    counts = write_bad_chat(tmp_path / "dialogues.jsonl", chat_rows[:60])
    cfg = DataConfig(
        sources=[SourceConfig(type="jsonl", path=str(tmp_path / "dialogues.jsonl"), format="chat")],
        shuffle_buffer=0,
        num_workers=0,
        max_bad_fraction=0.2,
    )
    loader = GlobalBatchLoader(cfg, tik, T, 2, 2)
    with caplog.at_level(logging.WARNING, logger="data"):
        take(loader, 40)  # more than one epoch: every bad row is met at least twice
    st = loader.stats()
    for kind, n in counts.items():
        assert st[f"dialogues/skipped_{kind}"] >= 2 * n and st[f"dialogues/skipped_{kind}"] % n == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "data"]
    assert sorted(line.split("skipping ")[1].split(" rows")[0] for line in lines) == sorted(counts)
    assert st["skipped_total"] == sum(st[f"dialogues/skipped_{k}"] for k in counts)


def test_too_many_bad_rows_stop_with_one_line_naming_the_source(tmp_path, chat_rows, tik):
    write_bad_chat(tmp_path / "d.jsonl", chat_rows[:20])
    cfg = DataConfig(
        sources=[SourceConfig(type="jsonl", path=str(tmp_path / "d.jsonl"), format="chat")],
        shuffle_buffer=0,
        num_workers=0,
    )
    with pytest.raises(DataError, match=r"sources\[0\] jsonl:.*records skipped.*max_bad_fraction") as e:
        take(GlobalBatchLoader(cfg, tik, T, 2, 2), 30)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_long_conversations_are_truncated_or_dropped_and_counted(chat_file, chat_rows, corpus_dir, tik, policy):
    from data.chat import encode_conversations, normalize_messages, renderer_for

    r = renderer_for(tik)
    lengths = [
        len(ids) for ids, _ in encode_conversations(tik, [r.render(normalize_messages(m)) for m in chat_rows])
    ]  # file order
    short = sorted(lengths)[len(lengths) // 2]  # half the dialogues are longer
    cfg = chat_cfg(chat_file, corpus_dir, only_chat=True, long_conversations=policy, shuffle_buffer=0)
    loader = GlobalBatchLoader(cfg, tik, short, 4, 4)
    rows = torch.cat([x["input_ids"] for x in take(loader, 5)])  # [20, short]
    st = loader.stats()
    met = st["conversations"] + st["conversations_dropped"]  # unshuffled: the first `met` dialogues of the file
    long = sum(n > short for n in lengths[:met])
    counted = {"truncate": "conversations_truncated", "drop": "conversations_dropped"}
    assert st[counted[policy]] == long > 0
    assert st[counted[{"truncate": "drop", "drop": "truncate"}[policy]]] == 0
    if policy == "drop":  # only whole conversations remain: every row's last real token ends a message
        last = [row[row != tik.pad_id][-1] for row in rows]
        assert all(t == tik.token_to_id("<|end_of_msg|>") for t in last)


def test_a_source_whose_conversations_are_all_too_long_stops_with_one_line(chat_file, corpus_dir, tik, monkeypatch):
    monkeypatch.setattr("data.packing._MAX_DROPPED_IN_A_ROW", 50)  # the mechanism, without 5 epochs of reading
    cfg = chat_cfg(chat_file, corpus_dir, only_chat=True, long_conversations="drop", shuffle_buffer=0)
    with pytest.raises(DataError, match="50 conversations in a row are longer than seq_len=8"):
        take(GlobalBatchLoader(cfg, tik, 8, 2, 2), 1)


def test_new_fields_leave_existing_text_fingerprints_unchanged():
    d = stream_dict(DataConfig())
    assert "long_conversations" not in d and "format" not in d["sources"][0] and "type" not in d["tokenizer"]
    assert "long_conversations" in stream_dict(DataConfig(long_conversations="drop"))


def test_parquet_without_the_text_field_is_one_line_data_error(tmp_path, tik):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": [f"doc {i}" for i in range(10)]}), tmp_path / "x.parquet")
    cfg = DataConfig(sources=[SourceConfig(type="parquet", path=str(tmp_path / "x.parquet"))], num_workers=0)
    with pytest.raises(
        DataError,
        match=r"has no column 'text' \(columns: content\): set data.sources\[0\]"
        r".text_field",
    ) as e:
        take(GlobalBatchLoader(cfg, tik, T, 2, 2), 1)
    assert "\n" not in str(e.value)


def test_mostly_malformed_jsonl_is_reported_as_malformed_data_not_a_vocabulary_failure(tmp_path, h):
    rng = np.random.default_rng(0)
    lines = ["not json" if rng.random() < 0.3 else json.dumps({"text": d}) for d in h.make_docs(300, 5)]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    cfg = DataConfig(
        sources=[SourceConfig(type="jsonl", path=str(tmp_path / "bad.jsonl"))], cache_dir=str(tmp_path / "cache")
    )
    with pytest.raises(DataError, match=r"records skipped \(\{'malformed_json': \d+\}\) > max_bad_fraction") as e:
        prepare_tokenizer(cfg)
    assert "sentencepiece" not in str(e.value) and "vocab" not in str(e.value)


def test_tiktoken_type_without_model_path_is_trained_once_and_cached(tmp_path, corpus_dir):
    cfg = DataConfig(
        sources=[SourceConfig(type="jsonl", path=str(corpus_dir / "small.jsonl"))], cache_dir=str(tmp_path)
    )
    cfg.tokenizer.type, cfg.tokenizer.vocab_size = "tiktoken", 600
    first = prepare_tokenizer(cfg)
    again = prepare_tokenizer(cfg)
    assert first.kind == again.kind == "tiktoken" and first.fingerprint == again.fingerprint
    assert first.vocab_size == 600 and len(list((tmp_path / "tokenizers").iterdir())) == 1
