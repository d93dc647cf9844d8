"""data/holdout.py: a source's held-out share is decided per record by a hash of its bytes, so no record is on
both sides, duplicates stay together, and a source without a share streams exactly as before."""

from __future__ import annotations

import json

from data import DataConfig, SourceConfig
from data.config import stream_dict
from data.sources import SourceStream


def _docs(src: SourceConfig) -> list[str]:
    s = SourceStream(src, 0, 0.01, report=False)
    out = []
    while (d := s.next_doc()) is not None:
        out.append(d)
    return out


def test_train_and_heldout_parts_partition_the_records_and_duplicates_stay_together(tmp_path):
    path = tmp_path / "docs.jsonl"
    texts = [f"document {i} " + "x" * (i % 7) for i in range(300)]
    lines = [json.dumps({"text": t}) for t in texts]
    path.write_text("\n".join(lines + lines[:50]) + "\n")  # the first 50 records twice
    base = SourceConfig(type="jsonl", path=str(path), holdout=0.2)
    train = _docs(base)
    held = _docs(SourceConfig(type="jsonl", path=str(path), holdout=0.2, part="heldout"))
    assert not set(train) & set(held)  # no document on both sides
    assert sorted(train + held) == sorted(texts + texts[:50])  # every record on exactly one side
    assert 30 <= len(set(held)) <= 90  # ~20% of 300
    assert _docs(SourceConfig(type="jsonl", path=str(path))) == texts + texts[:50]  # no share: everything


def test_a_source_without_a_share_keeps_its_loader_fingerprint():
    assert stream_dict(DataConfig(sources=[SourceConfig()])) == stream_dict(
        DataConfig(sources=[SourceConfig(holdout=0.0, part="train")])
    )
    assert "holdout" not in stream_dict(DataConfig())["sources"][0]
