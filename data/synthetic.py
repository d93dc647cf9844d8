"""A synthetic image–caption source drawn with Pillow: the embedded default of `experiment=vlm_smoke`.

Record i of a split is a function of (split, i) only (a generator seeded with both), so any position re-creates
exactly and resume is exact: one user turn with a 112 x 112 image and a question, one assistant turn with the
caption. Two kinds of picture:
- shapes: 1-4 filled circles / squares / triangles of one colour in a 2 x 2 grid -> "2 red circles";
- digits: one digit in a colour -> "the digit 7 in blue".
The caption names exactly what is drawn and the question is always the same, so it can only be predicted by
looking at the image (the `eval/caption/loss` / `loss_shuffled` gap of vlm_smoke measures that).
Source config: `type: synthetic`, `path: captions`, `format: chat`, `split: train | eval` (held out: other
indices' generator stream), `size` records per epoch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

GENERATORS = ("captions",)
IMAGE_SIDE = 112  # px: 4 x 4 merged cells of 28 px, 16 `<|media_pad|>` tokens per image
QUESTION = "What is in the picture?"
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (235, 210, 40)}
SHAPES = ("circle", "square", "triangle")
WORDS = {1: "1", 2: "2", 3: "3", 4: "4"}
_SPLIT_SALT = {"train": 0x747261, "eval": 0x65766C}


def example(index: int, split: str = "train") -> tuple[Any, str, dict]:
    """(PIL image, caption, what was drawn) of record `index` of `split`."""
    from PIL import Image, ImageDraw, ImageFont

    if split not in _SPLIT_SALT:
        raise ValueError(f"synthetic split {split!r} is not one of {sorted(_SPLIT_SALT)}")
    rng = np.random.default_rng([_SPLIT_SALT[split], int(index)])
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    img = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (250, 250, 250))
    draw = ImageDraw.Draw(img)
    if rng.random() < 0.25:
        digit = int(rng.integers(10))
        font = ImageFont.load_default(size=80)
        x, y = int(rng.integers(20, 36)), int(rng.integers(-4, 10))
        draw.text((x, y), str(digit), fill=COLOURS[colour], font=font)
        return img, f"the digit {digit} in {colour}", {"kind": "digit", "digit": digit, "colour": colour}
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    count = int(rng.integers(1, 5))
    cells = rng.permutation(4)[:count]
    half = IMAGE_SIDE // 2
    for c in cells:
        r = int(rng.integers(14, 21))  # half size of the shape
        cx = (c % 2) * half + half // 2 + int(rng.integers(-5, 6))
        cy = (c // 2) * half + half // 2 + int(rng.integers(-5, 6))
        box = (cx - r, cy - r, cx + r, cy + r)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
    noun = shape + ("s" if count > 1 else "")
    return img, f"{WORDS[count]} {colour} {noun}", {"kind": "shapes", "shape": shape, "count": count, "colour": colour}


def record(index: int, split: str = "train", image: Any = None) -> dict:
    """The chat record of `index` (`image` replaces the drawn picture: the shuffled-image evaluation)."""
    img, caption, _ = example(index, split)
    user = [{"type": "image", "image": img if image is None else image}, {"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": caption}]}


class IndexedRecords:
    """One epoch of `size` records, record i = `make(i, split)`, with the IterableDataset position API SourceStream
    uses: the state is the next index, so a resume continues exactly (the synthetic sources share it)."""

    def __init__(self, make: Callable[[int, str], dict], split: str, size: int) -> None:
        self.make, self.split, self.size, self.pos = make, split, int(size), 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, st: dict) -> None:
        self.pos = int(copy.deepcopy(st)["pos"])

    def __iter__(self) -> Iterator[dict]:
        while self.pos < self.size:
            self.pos += 1
            yield self.make(self.pos - 1, self.split)


class SyntheticCaptions(IndexedRecords):
    """The synthetic image-caption conversations as a source."""

    def __init__(self, name: str, split: str, size: int) -> None:
        if name not in GENERATORS:
            raise ValueError(f"synthetic source {name!r} is not one of {GENERATORS}")
        super().__init__(record, split, size)
