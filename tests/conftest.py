"""Shared test fixtures: deterministic torch, paths to the shared spec assets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny tensors: one thread avoids oversubscribing the 2-core CI machine (subprocess ranks inherit it too).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_K3 = REPO_ROOT.parent / "shared" / "k3"


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield


@pytest.fixture(scope="session")
def golden_tiny_dir() -> Path:
    path = SHARED_K3 / "golden-tiny"
    if not path.is_dir():
        pytest.skip(f"shared golden vector not found at {path}")
    return path
