"""The synthetic image–caption source (data/synthetic.py) and image packing (data/packing.py): records are a
function of (split, index), captions say what is drawn, and a packed row never holds part of an image block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data import GlobalBatchLoader, prepare_tokenizer
from data.config import DataConfig, SourceConfig, TokenizerConfig
from data.images import MEDIA_BEGIN, MEDIA_END, MEDIA_PAD, ImageRules
from data.synthetic import COLOURS, IMAGE_SIDE, SyntheticCaptions, example


def _pixels(img) -> np.ndarray:
    return np.asarray(img, dtype=np.int16)


def test_a_record_is_a_function_of_split_and_index():
    a, b = example(7, "train"), example(7, "train")
    assert a[1] == b[1] and np.array_equal(_pixels(a[0]), _pixels(b[0]))
    held_out = [example(i, "eval")[1] for i in range(40)]
    train = [example(i, "train")[1] for i in range(40)]
    assert held_out != train  # another generator stream


def test_resuming_the_stream_gives_the_same_records():
    full = SyntheticCaptions("captions", "train", 10)
    records = [r["messages"][1]["content"] for r in full]
    part = SyntheticCaptions("captions", "train", 10)
    it = iter(part)
    for _ in range(4):
        next(it)
    again = SyntheticCaptions("captions", "train", 10)
    again.load_state_dict(part.state_dict())
    assert [r["messages"][1]["content"] for r in again] == records[4:]


def _colour_pixels(img, colour: str) -> int:
    return int((np.abs(_pixels(img) - np.asarray(COLOURS[colour])).sum(-1) < 30).sum())


@pytest.mark.parametrize("index", range(24))
def test_the_caption_says_what_is_drawn(index):
    img, caption, what = example(index, "eval")
    assert img.size == (IMAGE_SIDE, IMAGE_SIDE) and what["colour"] in caption
    assert _colour_pixels(img, what["colour"]) > 100  # the named colour is drawn ...
    assert all(_colour_pixels(img, c) == 0 for c in COLOURS if c != what["colour"])  # ... and no other
    if what["kind"] == "shapes":
        assert caption.startswith(f"{what['count']} {what['colour']} {what['shape']}")
        ink = np.abs(_pixels(img) - 250).sum(-1) > 30
        half = IMAGE_SIDE // 2
        quads = [ink[r * half : (r + 1) * half, c * half : (c + 1) * half].any() for r in (0, 1) for c in (0, 1)]
        assert sum(quads) == what["count"]  # one shape per quadrant: the count is visible
    else:
        assert caption == f"the digit {what['digit']} in {what['colour']}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    cfg = DataConfig(
        sources=[SourceConfig(type="synthetic", path="captions", format="chat", size=64)],
        tokenizer=TokenizerConfig(type="tiktoken", vocab_size=600),
        cache_dir=str(tmp_path_factory.mktemp("cache")),
    )
    return cfg, prepare_tokenizer(cfg)


@pytest.mark.parametrize("seq_len", [20, 40, 72, 144])
def test_packed_rows_hold_whole_image_blocks_matching_their_pixels(tokenizer, seq_len):
    cfg, tok = tokenizer
    cfg.long_conversations = "truncate"
    loader = GlobalBatchLoader(cfg, tok, seq_len, 4, 2, images=ImageRules(), loss_on="all")
    begin, end, pad = (tok.token_to_id(t) for t in (MEDIA_BEGIN, MEDIA_END, MEDIA_PAD))
    for _ in range(6):
        mb = loader.next_microbatch()
        ids, labels = mb["input_ids"], mb["labels"]
        for row in ids:
            b, e = (row == begin).nonzero().flatten(), (row == end).nonzero().flatten()
            assert len(b) == len(e) and bool((b < e).all())  # every block that starts in a row ends there
            inside = torch.zeros_like(row, dtype=torch.bool)
            for i, j in zip(b.tolist(), e.tolist()):
                inside[i : j + 1] = True
            assert not ((row == pad) & ~inside).any()
        n_pads = int((ids == pad).sum())
        grids = mb.get("grid_thws", torch.zeros(0, 3, dtype=torch.long))
        assert n_pads == int((grids[:, 1] * grids[:, 2] // 4).sum())  # placeholders == the images' tokens
        assert not (labels == pad).any()  # image positions never carry loss, even under loss_on=all
        if n_pads:
            assert mb["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    stats = loader.stats()
    if seq_len < 40:  # shorter than a conversation's image block: every one is cut before its block
        assert stats["images"] == 0 and stats["conversations_truncated"] == stats["conversations"] > 0
    else:
        assert stats["images"] > 0 and 0 < stats["image_token_fraction"] < 1
    loader.close()
