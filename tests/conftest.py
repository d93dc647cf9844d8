"""Shared test fixtures: deterministic torch, paths to the shared spec assets, the EP=2 job two directories share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import EP2_JOB, must_succeed, run_training

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


# The 2-rank EP=2 job (EP2_JOB, tests/distributed/conftest.py) shared by tests/distributed/test_expert_parallel_train.py
# (its EP=2 reference: losses, biases, per-expert checkpoint files, resumes at EP=1) and tests/fault/test_kill.py (the
# uninterrupted job its killed jobs must reproduce). Here, in the root conftest, so both directories get the same
# session-scoped run (a fixture re-exported by each directory's conftest would run once per directory).
@pytest.fixture(scope="session")
def ep2_ref():
    """The uninterrupted EP=2 job (EP2_JOB) in its own temp dir (not pytest's tmp_path: concurrent pytest sessions
    prune each other's old base dirs)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="k3-ep2-ref-"))
    yield must_succeed(run_training(root / "ep2", EP2_JOB, nproc=2))
    shutil.rmtree(root, ignore_errors=True)
