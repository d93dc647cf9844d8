"""The caption task (training/eval/caption.py) in one process: its losses are the model's own caption CE of each
held-out example alone, with its own image or the next one's, whatever the rows per forward; a text model is
refused before training."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from data import DataConfig, SourceConfig
from data.bpe import build_tiktoken_dir
from data.images import batch_images
from model import K3ForConditionalGeneration
from model.k3 import IGNORE_INDEX, shift_targets
from tests.model.micro import micro_config
from tests.model.vision_micro import micro_vision, randomise
from training.eval.caption import CaptionTask
from training.eval.forward import EvalContext
from training.eval.sets import EvalConfigError

N = 5  # held-out examples (odd: the last forward of 2 rows is half padding)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A float64 micro multimodal K3 whose tower reads the synthetic images (112 px, patch 14: 16 tokens each) and a
    byte-level K3-layout tokenizer."""
    d = tmp_path_factory.mktemp("caption")
    (d / "text.jsonl").write_text("".join(json.dumps({"text": f"3 red circles {i}"}) + "\n" for i in range(20)))
    tok = build_tiktoken_dir(
        d / "tok", 512, DataConfig(sources=[SourceConfig(type="jsonl", path=str(d / "text.jsonl"))])
    )
    vision = micro_vision(patch_size=14, init_pos_emb_height=8, init_pos_emb_width=8)
    cfg = micro_config(
        vocab_size=512, vision_config=vision, media_placeholder_token_id=tok.token_to_id("<|media_pad|>")
    )
    torch.manual_seed(0)
    model = randomise(K3ForConditionalGeneration(cfg), std=0.2).double().eval()
    return model, cfg, tok


def _ctx(model, cfg, rows: int) -> EvalContext:
    return EvalContext(
        model, torch.device("cpu"), batch_rows=rows, media_id=cfg.media_placeholder_token_id, model_config=cfg
    )


@torch.no_grad()
def _reference(model, examples, shift: int) -> float:
    """Mean caption CE, one forward per example at its own length with image k + shift."""
    total, count = 0.0, 0
    for k, (ids_L, labels_L, _) in enumerate(examples):
        pixels, grids = batch_images([examples[(k + shift) % len(examples)][2]])
        out = model(ids_L[None], pixel_values=torch.from_numpy(pixels).double(), grid_thws=torch.from_numpy(grids))
        targets = shift_targets(labels_L[None], torch.tensor([0, len(ids_L)]))[0]
        total += float(F.cross_entropy(out.logits[0], targets, ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((targets != IGNORE_INDEX).sum())
    return total / count


def test_losses_are_each_examples_own_caption_ce_with_its_own_and_the_next_image(setup):
    model, cfg, tok = setup
    task = CaptionTask("caption", {"n": N}, tok, 256)
    got = task.evaluate(_ctx(model, cfg, rows=2))
    examples = task.examples(cfg)
    assert all(int((lab != IGNORE_INDEX).sum()) >= 2 for _, lab, _ in examples)  # a caption is scored, not markers
    true, shuffled = _reference(model, examples, 0), _reference(model, examples, 1)
    # (tasks take log-softmax of float32 logits, training/eval/forward.py: float32 resolution of a float64 model)
    assert got["loss"] == pytest.approx(true, rel=1e-6) and got["loss_shuffled"] == pytest.approx(shuffled, rel=1e-6)
    assert got["loss"] != pytest.approx(got["loss_shuffled"], rel=1e-6)  # the images reach the scores
    assert got["ratio"] == pytest.approx(got["loss"] / got["loss_shuffled"], rel=1e-12)
    again = task.evaluate(_ctx(model, cfg, rows=4))  # another split over forwards: the same numbers
    assert again["loss"] == pytest.approx(got["loss"], rel=1e-9)


def test_a_text_model_is_refused_naming_the_fix():
    cfg = OmegaConf.create({"model": {"vision_config": None}})
    with pytest.raises(EvalConfigError, match="model.vision_config"):
        CaptionTask.check({"type": "caption", "name": "caption"}, cfg)
