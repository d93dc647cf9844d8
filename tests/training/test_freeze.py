"""`train.freeze` (issue 23 §4): a frozen group gets no gradient, no optimizer state and no update; the vision
groups are refused in one line for a text model and accepted for a model with a tower."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import torch

from model import K3ForConditionalGeneration
from tests.model.vision_micro import MEDIA, images, micro_mm_config
from training.config import TrainConfigError, compose, validate
from training.engine import param_groups
from training.freeze import freeze

PREFIXES = {
    "vision_tower": ("vision_tower.",),
    "mm_projector": ("mm_projector.",),
    "language_model": ("language_model.",),
    "embeddings": ("language_model.model.embed_tokens.",),
}


@pytest.mark.parametrize("group", sorted(PREFIXES))
def test_each_group_freezes_exactly_its_parameters(group):
    m = K3ForConditionalGeneration(micro_mm_config())
    n = freeze(m, [group])
    frozen = {k for k, p in m.named_parameters() if not p.requires_grad}
    assert frozen == {k for k, _ in m.named_parameters() if k.startswith(PREFIXES[group])}
    assert n == sum(p.numel() for k, p in m.named_parameters() if k in frozen) > 0


def test_frozen_parameters_get_no_gradient_no_optimizer_state_and_no_update():
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(micro_mm_config())
    freeze(m, ["vision_tower", "embeddings"])
    before = {k: p.detach().clone() for k, p in m.named_parameters()}
    opt = torch.optim.AdamW(param_groups(m, 0.1), lr=1e-2)
    px, grid = images([(2, 4)], dtype=torch.float32)
    ids = torch.tensor([[1, 2, MEDIA, MEDIA, 3, 4, 5]])
    for _ in range(2):
        opt.zero_grad()
        m(ids, px, grid, labels=ids.masked_fill(ids == MEDIA, -100)).loss.backward()
        opt.step()
    for k, p in m.named_parameters():
        if k.startswith(("vision_tower.", "language_model.model.embed_tokens.")):
            assert p.grad is None and p not in opt.state and torch.equal(p, before[k]), k
    assert not torch.equal(m.mm_projector.proj[0].weight, before["mm_projector.proj.0.weight"])  # still trained


def test_vision_groups_are_refused_for_a_text_model_and_accepted_with_a_tower():
    with pytest.raises(TrainConfigError, match=r"train\.freeze=\['vision_tower'\]: the model has no vision tower"):
        validate(compose(["experiment=tiny_ci", "train.freeze=[vision_tower]"]), 1)
    validate(compose(["experiment=tiny_ci", "train.freeze=[embeddings]"]), 1)
    validate(compose(["experiment=vlm_smoke", "train.freeze=[vision_tower,mm_projector]"]), 1)


def test_a_training_run_never_updates_the_frozen_embedding(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "training.train",
            "experiment=tiny_ci",
            f"run_dir={tmp_path}",
            "logging.mode=disabled",
            "train.steps=2",
            "checkpoint.every=1",
            "checkpoint.keep_last=2",
            "train.freeze=[embeddings]",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    states = [
        torch.load(f, map_location="cpu", weights_only=True)["module"]
        for f in sorted(glob.glob(str(tmp_path / "checkpoints" / "step_*" / "mp_rank_00_model_states.pt")))
    ]
    assert len(states) == 2
    assert torch.equal(states[0]["model.embed_tokens.weight"], states[1]["model.embed_tokens.weight"])
    assert not torch.equal(states[0]["lm_head.weight"], states[1]["lm_head.weight"])
