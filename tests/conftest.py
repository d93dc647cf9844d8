"""Shared test fixtures: deterministic torch, paths to the shared spec assets, the EP=2 job two directories share;
which tests share a pytest-xdist worker, and in what order the units of work start."""

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
TESTS = Path(__file__).resolve().parent


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


# --- Two pytest-xdist workers (pyproject addopts: -n 2 --dist loadfile --no-loadscope-reorder) --------------------
# Each worker is a pytest session of its own: a session fixture runs once on every worker that needs it, a module
# fixture once on every worker that runs a test of its module. So a worker takes a whole unit at a time: a test file,
# or one of these sets of files (a session fixture they share runs once). Every launch picks a free master port
# (training/launch.py), so no two units need to wait for each other.
SHARED = {
    "ep2_ref": ("distributed/test_expert_parallel_train.py", "fault/test_kill.py", "distributed/test_eval_loop.py"),
    "ref_run": ("distributed/test_zero.py", "distributed/test_resume.py", "distributed/test_layouts.py"),
    "base_run": ("fault/test_run_identity.py", "fault/test_untrusted.py", "fault/test_data_faults.py"),
    "real_run": ("training/test_report.py", "training/test_generate_cli.py", "training/test_compare.py"),
    "data-fixtures": ("data/",),  # corpus, tokenizers (tests/data/conftest.py)
    "multinode": ("multinode/",),  # the two namespace nodes, their Slurm, the two-node reference job
}
# Units start in this order, about the longest first (seconds of `pytest --durations` in a fresh clone on an idle
# 2-core machine, both workers busy, 2026-12-05; the first nine re-measured 2026-12-06), so the two workers end
# together: a unit not listed starts after these, in collection order (all of them are short).
FIRST = (
    "test_documented_commands.py",  # 282 (fresh clone, idle, 2026-12-06 07:30 run: the numbers below)
    "ep2_ref",  # 54 + 39 + eval loop 61 + 47
    "multinode",  # 46 + 34 + 28 + 17
    "distributed/test_zero3_ep.py",  # 78 (CPU Adam prebuilt by `make ops`)
    "ref_run",  # 26 + 26 + 25
    "distributed/test_sequence_parallel.py",  # 124 + 19
    "distributed/test_vision_train.py",  # 101 (7 launches, 6 at once)
    "distributed/test_muon_zero.py",  # 57
    "training/test_plan_zero3_sp.py",  # 48
    "base_run",  # 17 + 5 + 5 + 3 + 3
    "training/test_entry_points.py",  # 11 + 3 + 3
    "fault/test_sweep.py",  # 31
    "training/test_lora_plan.py",  # 20
    "training/test_lora.py",  # 20 + 8 + 7 + 5 + 4
    "training/test_sft.py",  # 9 + 6 + 5
    "distributed/test_launch.py",  # 21
    "distributed/test_expert_parallel_engine.py",  # 21
    "distributed/test_lora.py",  # 26
    "fault/test_nonfinite.py",  # 12
    "training/test_export_stream.py",  # 57 with the machine loaded (load average ~15 on 2 cores)
    "distributed/test_mtp_train.py",  # 30 (two 2-rank jobs and a 1-rank one at once)
    "training/test_run_files.py",  # 7 + 5
    "fault/test_soak.py",  # 9
    "fault/test_processes.py",  # 8
    "model/test_typecheck.py",  # 10
    "training/test_freeze.py",  # 5
)


def unit(path: Path) -> str:
    """The unit of work the test file `path` belongs to."""
    rel = path.resolve().as_posix().removeprefix(f"{TESTS.as_posix()}/")
    return next((name for name, files in SHARED.items() if any(rel.startswith(f) for f in files)), rel)


def pytest_collection_modifyitems(config, items):
    """The units longest first (a unit's tests stay together, in file order, so module fixtures are set up once)."""
    rank = {name: i for i, name in enumerate(FIRST)}
    order = {item: (rank.get(unit(Path(item.path)), len(FIRST)), i) for i, item in enumerate(items)}
    items.sort(key=order.__getitem__)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadfile scheduling, a unit (`unit`) in place of a file. (Not `--dist loadgroup` with xdist_group
    marks: xdist 3.8 appends the group to each test's node id, which pytest 9.2 no longer lets a plugin change, so
    every test became a unit of its own and the module fixtures ran on both workers.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class UnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit(config.rootpath / nodeid.split("::", 1)[0])

    return UnitScheduling(config, log)
