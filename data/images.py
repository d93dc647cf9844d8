"""Images for K3's vision tower: decode (Pillow), the one resize rule, patches, and their placeholder tokens.

An image part is `{"type": "image", "image": <path | bytes | datasets Image value | PIL.Image>}`; a datasets
`Image` column arrives either decoded (a PIL image) or as `{"bytes": ..., "path": ...}`, both accepted.

The resize rule (data/README.md "Images"), with patch p = 14, merge m = 2 (cell c = p·m = 28 px), at most
`in_patch_limit` patches per image and `patch_limit_per_side` per side:
1. an image with a side shorter than p pixels is too small (the row is skipped, `image_too_small`);
2. scale s = min(1, sqrt(in_patch_limit·p² / (W·H)), patch_limit_per_side·p / W, patch_limit_per_side·p / H)
   (never upscale);
3. each side becomes the nearest multiple of c to side·s (at least c, at most the per-side limit rounded down to
   c); while the patch count is over the limit, the longer side loses one cell;
4. RGB, resized with Pillow's bicubic filter, values x / 255 normalised as (x − 0.5) / 0.5 (mean = std = 0.5);
5. patches row-major: pixel_values [N, 3, p, p], grid (1, H'/p, W'/p); the LM sees N / m² = (H'/c)·(W'/c) tokens.

In the conversation an image becomes `<|media_begin|>` + `image {W'}x{H'}` + `<|media_content|>` + one
`<|media_pad|>` per LM token + `<|media_end|>`; the projected features replace the pads, and no position of the
block carries loss.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
)
IMAGE_SKIP_REASONS = ("image_missing", "image_undecodable", "image_too_small")


class ImageError(Exception):
    """An image that cannot be used; `kind` is one of IMAGE_SKIP_REASONS (its row is skipped and counted)."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass(frozen=True)
class ImageRules:
    """The tower's input geometry (the model's vision_config: patch_size, merge_kernel_size, limits)."""

    patch_size: int = 14
    merge: int = 2
    in_patch_limit: int = 65_536
    patch_limit_per_side: int = 512

    @property
    def cell(self) -> int:
        return self.patch_size * self.merge


@dataclass(frozen=True)
class PreparedImage:
    pixel_values: np.ndarray  # [N, 3, p, p] float32, patches row-major
    grid: tuple[int, int, int]  # (1, h, w) patches
    size: tuple[int, int]  # (W', H') pixels after the resize
    num_tokens: int  # LM tokens = `<|media_pad|>` placeholders: (h / m) x (w / m) merged patches


def decode_image(obj: Any):
    """A PIL RGB image from a path, bytes, a datasets Image value or a PIL image; ImageError otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(obj, dict):  # datasets Image feature, undecoded
        obj = obj.get("bytes") or obj.get("path")
    if obj is None:
        raise ImageError("image_missing", "the image part holds nothing")
    if isinstance(obj, Image.Image):
        img = obj
    else:
        if isinstance(obj, (str, os.PathLike)):
            if not os.path.isfile(obj):
                raise ImageError("image_missing", f"no file {os.fspath(obj)}")
            src: Any = os.fspath(obj)
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            src = io.BytesIO(bytes(obj))
        else:
            raise ImageError("image_undecodable", f"an image part of type {type(obj).__name__}")
        try:
            img = Image.open(src)
            img.load()
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise ImageError("image_undecodable", str(e)) from None
    return img.convert("RGB")


def resize_size(width: int, height: int, rules: ImageRules) -> tuple[int, int]:
    """(W', H') of the resize rule (module docstring, steps 1-3); ImageError for a too-small image."""
    p, c = rules.patch_size, rules.cell
    if min(width, height) < p:
        raise ImageError("image_too_small", f"{width}x{height} px has a side under one {p} px patch")
    s = min(
        1.0,
        math.sqrt(rules.in_patch_limit * p * p / (width * height)),
        rules.patch_limit_per_side * p / width,
        rules.patch_limit_per_side * p / height,
    )
    side_max = max(c, (rules.patch_limit_per_side * p) // c * c)
    w, h = (min(side_max, max(c, round(x * s / c) * c)) for x in (width, height))
    while (w // p) * (h // p) > rules.in_patch_limit:
        if w >= h:
            w -= c
        else:
            h -= c
    return w, h


def prepare_image(obj: Any, rules: ImageRules) -> PreparedImage:
    """Decode, resize, normalise and cut into patches (module docstring)."""
    from PIL import Image

    img = decode_image(obj)
    w, h = resize_size(img.width, img.height, rules)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.Resampling.BICUBIC)
    x = (np.asarray(img, dtype=np.float32) / 255.0 - 0.5) / 0.5  # [H', W', 3]
    p = rules.patch_size
    gh, gw = h // p, w // p
    patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
    tokens = (gh // rules.merge) * (gw // rules.merge)
    return PreparedImage(np.ascontiguousarray(patches), (1, gh, gw), (w, h), tokens)


def batch_images(images: list[PreparedImage]) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [sum N, 3, p, p], grid_thws [n, 3] int64) of a conversation's (or a batch's) images, in order."""
    if not images:
        return np.zeros((0, 3, 1, 1), dtype=np.float32), np.zeros((0, 3), dtype=np.int64)
    return np.concatenate([im.pixel_values for im in images]), np.asarray([im.grid for im in images], dtype=np.int64)
