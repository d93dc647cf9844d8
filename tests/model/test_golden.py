"""Golden logits: the shared released-layout tiny checkpoint, and the repo's own fixed-seed micro checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.hf import load_hf_checkpoint

REPO_GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "micro"


def golden_error(ckpt: Path, dtype: torch.dtype) -> tuple[float, float]:
    """(max |logit - expected|, max |expected|) running `ckpt` in `dtype`."""
    model = load_hf_checkpoint(ckpt, dtype=dtype).eval()
    ref = load_file(str(ckpt / "golden.safetensors"))
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits.double()
    return float((logits - ref["logits"]).abs().max()), float(ref["logits"].abs().max())


def test_shared_golden_tiny_fp64_matches_reference(golden_tiny_dir):
    err, _ = golden_error(golden_tiny_dir, torch.float64)
    assert err <= 1e-8


def test_shared_golden_tiny_fp32_matches_reference(golden_tiny_dir):
    err, _ = golden_error(golden_tiny_dir, torch.float32)
    assert err <= 2e-4


def test_repo_golden_micro_logits_have_not_drifted():
    if not (REPO_GOLDEN / "golden.safetensors").is_file():
        pytest.fail(f"{REPO_GOLDEN} is missing; regenerate with `python -m tests.golden.make`")
    err, scale = golden_error(REPO_GOLDEN, torch.float64)
    assert err <= 1e-6 * scale
