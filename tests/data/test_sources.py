"""Sources: file resolution, formats, bad input (skipped + counted, or a one-line error), exact positions."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import DataConfig, DataError, GlobalBatchLoader, SourceConfig
from data.sources import SourceStream


def read_epoch(stream: SourceStream) -> list[str]:
    out = []
    while (doc := stream.next_doc()) is not None:
        out.append(doc)
    return out


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("path", ["missing.jsonl", "nothing/*.jsonl"])
def test_missing_path_or_empty_glob_is_a_one_line_error_naming_it(tmp_path, path):
    src = SourceConfig(type="jsonl", path=str(tmp_path / path))
    with pytest.raises(DataError) as e:
        SourceStream(src, 0, 0.0)
    assert str(tmp_path / path) in one_line_error(e)


def test_directory_without_matching_files_is_a_one_line_error(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="no .jsonl"):
        SourceStream(SourceConfig(type="jsonl", path=str(tmp_path)), 0, 0.0)


def test_directory_and_glob_read_all_files_in_sorted_order(h, tmp_path):
    h.write_jsonl(tmp_path / "b" / "2.jsonl", ["two"])
    h.write_jsonl(tmp_path / "a" / "1.jsonl", ["one"])
    h.write_jsonl(tmp_path / "b" / "3.jsonl", ["three"])
    by_dir = read_epoch(SourceStream(SourceConfig(type="jsonl", path=str(tmp_path)), 0, 0.0))
    by_glob = read_epoch(SourceStream(SourceConfig(type="jsonl", path=str(tmp_path / "*" / "*.jsonl")), 0, 0.0))
    assert by_dir == by_glob == ["one", "two", "three"]


def test_bad_records_are_skipped_and_counted_by_reason(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"text": "good one"}).encode(),
        b"{not json",
        b"",
        b"   ",
        json.dumps({"other": "no text field"}).encode(),
        json.dumps({"text": 7}).encode(),
        b'{"text": "bad \xff\xfe bytes"}',
        json.dumps({"text": "  "}).encode(),
        b"[1, 2]",
        json.dumps({"text": "good two \u00e9"}, ensure_ascii=False).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    stream = SourceStream(SourceConfig(type="jsonl", path=str(path)), 0, max_bad_fraction=1.0)
    assert read_epoch(stream) == ["good one", "good two \u00e9"]
    assert stream.skipped == {"invalid_utf8": 1, "malformed_json": 2, "missing_field": 1, "not_text": 1, "empty": 3}


def test_bad_fraction_above_limit_is_a_one_line_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([json.dumps({"text": f"ok {i}"}) for i in range(8)] + ["{oops"] * 2) + "\n")
    read_epoch(SourceStream(SourceConfig(type="jsonl", path=str(path)), 0, max_bad_fraction=0.2))  # 20%: fine
    with pytest.raises(DataError, match="2 of 10 records skipped.*max_bad_fraction=0.1") as e:
        read_epoch(SourceStream(SourceConfig(type="jsonl", path=str(path)), 0, max_bad_fraction=0.1))
    one_line_error(e)


def test_empty_source_is_a_clear_error_not_an_infinite_wait(tmp_path, small_tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    cfg = DataConfig(sources=[SourceConfig(type="jsonl", path=str(tmp_path / "empty.jsonl"))], num_workers=1)
    loader = GlobalBatchLoader(cfg, small_tokenizer, seq_len=16, global_batch_size=2, micro_batch_size=2)
    with pytest.raises(DataError, match="no usable documents") as e:
        loader.next_microbatch()
    one_line_error(e)


def test_source_with_only_unusable_records_is_an_error(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"title": "no text"}\n' * 3)
    with pytest.raises(DataError, match="missing_field"):
        read_epoch(SourceStream(SourceConfig(type="jsonl", path=str(tmp_path / "x.jsonl")), 0, 0.5))


def test_text_source_skips_empty_lines_and_invalid_utf8(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"first line\n\nsecond \xc3\xa9 line\n\xff\xfe broken\n   \nlast\n")
    stream = SourceStream(SourceConfig(type="text", path=str(tmp_path / "a.txt")), 0, 1.0)
    assert read_epoch(stream) == ["first line", "second é line", "last"]
    assert (stream.skipped["empty"], stream.skipped["invalid_utf8"]) == (2, 1)


def test_text_source_by_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nstill one\n\npara two\n")
    src = SourceConfig(type="text", path=str(tmp_path / "a.txt"), text_sample_by="paragraph")
    assert read_epoch(SourceStream(src, 0, 0.0)) == ["para one\nstill one", "para two\n"]


def test_parquet_source_reads_text_field_and_counts_nulls(tmp_path):
    pq.write_table(pa.table({"content": ["p one", None, "p two"], "id": [1, 2, 3]}), tmp_path / "a.parquet")
    stream = SourceStream(SourceConfig(type="parquet", path=str(tmp_path), text_field="content"), 0, 1.0)
    assert read_epoch(stream) == ["p one", "p two"]
    assert stream.skipped["missing_field"] == 1


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_state_restores_position_exactly_twice_in_a_row(h, tmp_path, kind):
    for k in range(3):
        docs = h.make_docs(40, k, f"f{k}-")
        if kind == "jsonl":
            h.write_jsonl(tmp_path / f"{k}.jsonl", docs)
        else:  # several row groups per file
            pq.write_table(pa.table({"text": docs}), tmp_path / f"{k}.parquet", row_group_size=16)
    src = SourceConfig(type=kind, path=str(tmp_path / f"*.{kind}"))
    full = read_epoch(SourceStream(src, 0, 0.0))
    assert len(full) == 120
    first = SourceStream(src, 0, 0.0)
    got = [first.next_doc() for _ in range(50)]
    second = SourceStream(src, 0, 0.0)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [second.next_doc() for _ in range(45)]
    third = SourceStream(src, 0, 0.0)
    third.load_state_dict(json.loads(json.dumps(second.state_dict())))
    got += read_epoch(third)
    assert got == full


def test_gzipped_jsonl_is_read_transparently(tmp_path):
    import gzip

    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": f"zipped {i} é"}) + "\n" for i in range(3)))
    stream = SourceStream(SourceConfig(type="jsonl", path=str(tmp_path)), 0, 0.0)
    assert read_epoch(stream) == [f"zipped {i} é" for i in range(3)]


def test_unreachable_hub_dataset_is_a_one_line_error_naming_it():
    stream = SourceStream(SourceConfig(type="hub", path="nobody/no-such-dataset"), 0, 0.0)  # tests run offline
    with pytest.raises(DataError, match="sources\\[0\\] hub:nobody/no-such-dataset") as e:
        stream.next_doc()
    one_line_error(e)
