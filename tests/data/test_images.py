"""Images in conversations (issue 23 §3): Pillow decode of every accepted form, the documented resize rule, patches,
the K3 placeholder block and its loss mask, one skip kind per bad image."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from PIL import Image

from data.chat import ChatRowError, K3Renderer, conversation_images, encode_conversations, normalize_messages
from data.images import ImageError, ImageRules, batch_images, decode_image, prepare_image, resize_size

RULES = ImageRules()


def _png(w: int, h: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


# --- decode -------------------------------------------------------------------------------------------------------


def test_every_accepted_image_form_decodes_to_the_same_rgb_pixels(tmp_path):
    data = _png(30, 20)
    (tmp_path / "a.png").write_bytes(data)
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    forms = [
        str(tmp_path / "a.png"),
        tmp_path / "a.png",
        data,
        {"bytes": data, "path": None},
        {"bytes": None, "path": str(tmp_path / "a.png")},
        Image.open(io.BytesIO(data)).convert("RGBA"),
    ]
    for form in forms:
        img = decode_image(form)
        assert img.mode == "RGB" and np.array_equal(np.asarray(img), ref), type(form)


@pytest.mark.parametrize(
    "obj, kind",
    [
        ("no/such.png", "image_missing"),
        (None, "image_missing"),
        (b"not an image", "image_undecodable"),
        (3, "image_undecodable"),
    ],
)
def test_a_bad_image_is_one_skip_kind(obj, kind):
    with pytest.raises(ImageError) as e:
        decode_image(obj)
    assert e.value.kind == kind


# --- the resize rule ------------------------------------------------------------------------------------------------


def test_resize_keeps_small_images_and_rounds_sides_to_28():
    assert resize_size(100, 50, RULES) == (112, 56)  # 3.57 -> 4 cells, 1.79 -> 2 cells
    assert resize_size(28, 28, RULES) == (28, 28)
    assert resize_size(14, 300, RULES) == (28, 308)  # at least one cell per side


def test_resize_respects_the_patch_limits_and_the_aspect_ratio():
    rng = random.Random(0)
    for rules in (RULES, ImageRules(in_patch_limit=256, patch_limit_per_side=24)):
        for _ in range(300):
            w, h = rng.randint(14, 20000), rng.randint(14, 20000)
            W, H = resize_size(w, h, rules)
            p = rules.patch_size
            assert W % 28 == 0 and H % 28 == 0
            assert (W // p) * (H // p) <= rules.in_patch_limit
            assert max(W, H) // p <= rules.patch_limit_per_side
            if min(W, H) >= 10 * 28:  # away from the one-cell floor, rounding moves the ratio by under 10 %
                assert abs(math.log((W / H) / (w / h))) < 0.1


def test_release_limits_fit_a_huge_image_to_65536_patches():
    W, H = resize_size(10_000, 10_000, RULES)
    assert (W, H) == (3584, 3584) and (W // 14) * (H // 14) == 65_536


def test_too_small_images_are_refused():
    with pytest.raises(ImageError) as e:
        resize_size(13, 500, RULES)
    assert e.value.kind == "image_too_small"


# --- patches ------------------------------------------------------------------------------------------------------


def test_patches_are_row_major_normalised_14x14_blocks():
    arr = np.random.default_rng(1).integers(0, 256, (28, 56, 3), dtype=np.uint8)  # already on the 28 px grid
    im = prepare_image(Image.fromarray(arr), RULES)
    assert im.grid == (1, 2, 4) and im.size == (56, 28) and im.num_tokens == 2
    assert im.pixel_values.shape == (8, 3, 14, 14) and im.pixel_values.dtype == np.float32
    for r in range(2):
        for c in range(4):
            block = arr[14 * r : 14 * r + 14, 14 * c : 14 * c + 14].astype(np.float32).transpose(2, 0, 1)
            np.testing.assert_allclose(im.pixel_values[4 * r + c], (block / 255 - 0.5) / 0.5, rtol=0, atol=1e-6)


# --- conversations --------------------------------------------------------------------------------------------------


def _conv(*images) -> list[dict]:
    content = [{"type": "text", "text": "Look: "}]
    content += [{"type": "image", "image": im} for im in images]
    content += [{"type": "text", "text": " what is it?"}]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": "A square."}]


def test_an_image_becomes_its_placeholder_block_with_n_pads():
    msgs = normalize_messages(_conv(_png(100, 50)), images=RULES)
    assert msgs[0]["content"] == "Look:  what is it?"
    text = K3Renderer().text(msgs)
    assert "Look: <|media_begin|>image 112x56<|media_content|>" + "<|media_pad|>" * 8 + "<|media_end|> what" in text
    (im,) = conversation_images(msgs)
    assert im.grid == (1, 4, 8) and im.num_tokens == 8


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_no_position_of_an_image_block_carries_loss(tik, loss_on):
    msgs = normalize_messages(_conv(_png(60, 60), _png(40, 90, seed=2)), images=RULES)
    ((ids, mask),) = encode_conversations(tik, [K3Renderer().render(msgs)], loss_on)
    begin, end, pad = (tik.token_to_id(t) for t in ("<|media_begin|>", "<|media_end|>", "<|media_pad|>"))
    starts, ends = np.flatnonzero(ids == begin), np.flatnonzero(ids == end)
    assert len(starts) == len(ends) == 2
    inside = np.zeros(len(ids), dtype=bool)
    for s, e in zip(starts, ends):
        inside[s : e + 1] = True
    assert not mask[inside].any()
    assert mask[~inside].any()  # the assistant's answer (and, under loss_on=all, the user text) still learns
    assert int((ids == pad).sum()) == sum(im.num_tokens for im in conversation_images(msgs))
    px, grid = batch_images(conversation_images(msgs))
    assert px.shape[0] == int(grid[:, 1:].prod(-1).sum()) and grid.tolist() == [
        [1, 4, 4],
        [1, 6, 2],
    ]  # 60x60 -> 56x56; 40x90 -> 28x84


def test_image_parts_without_a_tower_or_with_a_bad_image_skip_the_row(tmp_path):
    with pytest.raises(ChatRowError) as e:
        normalize_messages(_conv(_png(60, 60)))
    assert e.value.kind == "bad_message"
    with pytest.raises(ChatRowError) as e:
        normalize_messages(_conv(str(tmp_path / "gone.png")), images=RULES)
    assert e.value.kind == "image_missing"
    with pytest.raises(ChatRowError) as e:
        normalize_messages(_conv(_png(8, 8)), images=RULES)
    assert e.value.kind == "image_too_small"
