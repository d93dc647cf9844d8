"""DataConfig: usable as a Hydra/OmegaConf structured group, validated with one-line errors."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from data import DataConfig, DataError, SourceConfig
from data.config import coerce_config, stream_dict


def test_default_config_is_the_embedded_no_network_setup():
    cfg = DataConfig()
    assert [s.type for s in cfg.sources] == ["embedded"] and cfg.tokenizer.model_path is None
    assert cfg.tokenizer.vocab_size == 4096


def test_config_round_trips_through_omegaconf_structured_and_dictconfig():
    structured = OmegaConf.structured(DataConfig)
    merged = OmegaConf.merge(
        structured,
        {
            "sources": [{"type": "jsonl", "path": "x.jsonl", "weight": 2.0}],
            "shuffle_buffer": 7,
            "tokenizer": {"vocab_size": 512},
        },
    )
    cfg = coerce_config(merged)
    assert isinstance(cfg, DataConfig) and isinstance(cfg.sources[0], SourceConfig)
    assert (cfg.sources[0].weight, cfg.shuffle_buffer, cfg.tokenizer.vocab_size) == (2.0, 7, 512)
    assert coerce_config(OmegaConf.to_container(merged)) == cfg


def test_worker_settings_do_not_change_the_stream_identity():
    assert stream_dict(DataConfig(num_workers=0, prefetch=9, cache_dir="/x")) == stream_dict(DataConfig())
    assert stream_dict(DataConfig(shuffle_buffer=3)) != stream_dict(DataConfig())


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"sources": []}, "data.sources is empty"),
        ({"sources": [SourceConfig(type="csv", path="a")]}, r"sources\[0\].type='csv'"),
        ({"sources": [SourceConfig(type="jsonl", path="")]}, r"sources\[0\].path is empty"),
        ({"sources": [SourceConfig(type="jsonl", path="a", weight=0)]}, r"weight=0 must be > 0"),
        ({"exhaustion": "forever"}, "data.exhaustion='forever'"),
        ({"packing": "best"}, "data.packing='best'"),
        ({"max_bad_fraction": 2.0}, "max_bad_fraction=2.0"),
        ({"num_workers": 4}, "num_workers=4"),
    ],
)
def test_invalid_settings_are_one_line_errors_naming_the_key(kw, match):
    with pytest.raises(DataError, match=match) as e:
        coerce_config(DataConfig(**kw))
    assert "\n" not in str(e.value)


def test_unknown_key_is_an_error():
    with pytest.raises(DataError, match=r"unknown data config key\(s\) \['shufle'\]"):
        coerce_config({"shufle": 3})


def test_source_names_are_metric_safe_unique_stems_and_explicit_duplicates_fail():
    from data.config import source_names

    srcs = [
        SourceConfig(type="jsonl", path="data/*.jsonl"),
        SourceConfig(type="hub", path="org/my.ds"),
        SourceConfig(),
        SourceConfig(type="jsonl", path="a/b.jsonl"),
        SourceConfig(type="jsonl", path="c/b.jsonl"),
    ]
    assert source_names(DataConfig(sources=srcs)) == ["data", "my", "embedded", "b", "b4"]
    with pytest.raises(DataError, match="names .* are not unique"):
        coerce_config(DataConfig(sources=[SourceConfig(name="x"), SourceConfig(name="x")]))


def test_chat_format_needs_records_and_choices_are_checked():
    with pytest.raises(DataError, match="format=chat needs records"):
        coerce_config(DataConfig(sources=[SourceConfig(type="text", path="x.txt", format="chat")]))
    for key, bad in (("long_conversations", "keep"),):
        with pytest.raises(DataError, match=key):
            coerce_config({key: bad})
    with pytest.raises(DataError, match="data.tokenizer.type='bpe'"):
        coerce_config({"tokenizer": {"type": "bpe"}})
    with pytest.raises(DataError, match="too small for a tiktoken tokenizer"):
        coerce_config({"tokenizer": {"type": "tiktoken", "vocab_size": 300}})
