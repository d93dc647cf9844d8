"""Fault-suite helpers: real training jobs (tests/distributed/conftest.py launchers) plus state comparisons.

Fast tests run in CI; tests marked `fault_matrix` are the full matrix (more kill steps, the 2,000-step soak) and
only run with K3_FAULT_FULL=1 (launch/fault_matrix.sh sets it): `pytest tests/fault -m fault_matrix`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.distributed.conftest import (  # noqa: F401  (re-exported for the fault tests)
    REF,
    REF_STEPS,
    TINY,
    TINY_WANDB,
    RunResult,
    must_succeed,
    read_metrics,
    ref_run,
    run_training,
)

FULL = os.environ.get("K3_FAULT_FULL") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "fault_matrix: full fault matrix only (K3_FAULT_FULL=1)")


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="full fault matrix: run launch/fault_matrix.sh (K3_FAULT_FULL=1)")
    for item in items:
        if "fault_matrix" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def runs_root():
    root = Path(tempfile.mkdtemp(prefix="k3-fault-runs-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def ckpt_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def load_states(tag_dir: Path) -> tuple[dict, dict]:
    """(model-states file dict: module, lr_scheduler, ...; optimizer state) of a 1-rank DeepSpeed checkpoint,
    loaded weights-only."""
    from training.checkpoint.safe_load import safe_torch_load

    model = safe_torch_load(str(tag_dir / "mp_rank_00_model_states.pt"))
    optim_files = sorted(tag_dir.glob("*optim_states.pt"))
    optim = safe_torch_load(str(optim_files[0]))["optimizer_state_dict"] if optim_files else {}
    return model, optim


def tensors_of(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a nested dict/list, keyed by its path (for bitwise comparisons)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors_of(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors_of(v, f"{prefix}/{i}"))
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().contiguous().reshape(-1).view(torch.uint8)


def bitwise_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ in any bit (or exist on one side only)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(_bits(x), _bits(y)):
            bad.append(k)
    return bad


SECRET = "k3-fault-test-wandb-key-5f0c1d2e9a7b"
BASE_STEPS = 4
MAX_LINE = 3_000_000  # a gigantic line: 3 MB of unparsable JSON


def write_bad_jsonl(path: Path) -> dict[str, int]:
    """A JSON Lines file with good documents and every kind of malformed record; returns the bad counts."""
    import json
    import random

    rng = random.Random(0)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "with",
        "was",
        "on",
        "be",
        "by",
        "this",
        "are",
        "from",
        "at",
        "or",
        "an",
        "which",
    ]
    good = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))}) for _ in range(400)]
    bad = {
        "malformed_json": [b'{"text": "unterminated', b"not json at all", b"{" + b"x" * MAX_LINE],
        "missing_field": [b'{"content": "no text field"}', b'{"text": null}'],
        "invalid_utf8": [b'{"text": "bad \xff\xfe bytes"}'],
        "empty": [b"", b"   ", b'{"text": ""}'],
    }
    lines = [g.encode() for g in good]
    for i, rec in enumerate(r for rs in bad.values() for r in rs):
        lines.insert(3 + 7 * i, rec)  # early in the file: read within the first steps
    lines.insert(60, json.dumps({"text": " ".join(words) * 5_000}).encode())  # a gigantic VALID line (~440 kB)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {k: len(v) for k, v in bad.items()}


@pytest.fixture(scope="session")
def tokenizer_path(runs_root) -> str:
    """The default (embedded-corpus) tokenizer, so a small user corpus needs no tokenizer training."""
    from data import DataConfig, prepare_tokenizer

    return str(prepare_tokenizer(DataConfig()).save(runs_root / "tok"))


@pytest.fixture(scope="session")
def base_run(runs_root, tokenizer_path) -> RunResult:
    """1 rank, malformed data source, W&B key in the env, checkpoints every step: shared by several faults."""
    corpus = runs_root / "bad.jsonl"
    bad = write_bad_jsonl(corpus)
    res = run_training(
        runs_root / "base",
        [
            *TINY_WANDB,
            f"train.steps={BASE_STEPS}",
            "checkpoint.every=1",
            "checkpoint.keep_last=10",
            f"data.sources=[{{type: jsonl, path: {corpus}}}]",
            f"data.tokenizer.model_path={tokenizer_path}",
            "data.max_bad_fraction=0.5",
            "data.shuffle_buffer=1",
        ],
        launcher=False,
        env={"WANDB_API_KEY": SECRET},
    )
    res.bad_counts = bad  # type: ignore[attr-defined]
    return must_succeed(res)


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def resume_overrides(run: RunResult, steps: int, allow: tuple[str, ...] = ()) -> list[str]:
    """The base run's own resolved config (config.yaml), continued to `steps` (other than the base's 4: with
    checkpoint.allow_changes=[train.steps]) with the `allow` changes allowed too."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run.run_dir / "config.yaml")
    src = cfg.data.sources[0]
    allowed = [*allow, *(["train.steps"] if steps != BASE_STEPS and "train.steps" not in allow else [])]
    return [
        *TINY_WANDB,
        f"train.steps={steps}",
        "checkpoint.every=1",
        "checkpoint.keep_last=10",
        f"data.sources=[{{type: jsonl, path: {src.path}}}]",
        f"data.tokenizer.model_path={cfg.data.tokenizer.model_path}",
        "data.max_bad_fraction=0.5",
        "data.shuffle_buffer=1",
        *([f"checkpoint.allow_changes=[{','.join(allowed)}]"] if allowed else []),
    ]


def record(fault: str, survived: bool, data_lost: bool, detail: str = "") -> None:
    """One trial of the fault matrix -> $K3_FAULT_REPORT (JSONL) for launch/fault_matrix.sh's table."""
    import json

    path = os.environ.get("K3_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(
                json.dumps({"fault": fault, "survived": bool(survived), "data_lost": bool(data_lost), "detail": detail})
                + "\n"
            )


def partial_tags(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(d.name for d in root.glob("step_*") if not (d / "COMPLETE").is_file()) if root.is_dir() else []


def run_and_kill_launcher(
    run_dir: Path, overrides: list[str], at_step: int, whole_group: bool = True, nproc: int = 2, timeout: int = 600
) -> RunResult:
    """Start the deepspeed launcher, wait until metrics.jsonl reaches `at_step`, then SIGKILL the launcher's whole
    process group (what a scheduler or OOM-killer of the job does) or only the launcher process."""
    import signal
    import subprocess
    import time

    from tests.distributed.conftest import REPO, job_env
    from training.launch import launch_command

    cmd = launch_command([f"run_dir={run_dir}", *overrides], nproc, "training/train.py")
    p = subprocess.Popen(
        cmd, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    t0 = time.time()
    while time.time() - t0 < timeout and p.poll() is None:
        m = read_metrics(run_dir)
        if m and m[-1]["step"] >= at_step:
            break
        time.sleep(0.05)
    killed_at = time.time()
    if whole_group:
        os.killpg(p.pid, signal.SIGKILL)
    else:
        p.kill()
    out, err = p.communicate(timeout=60)
    res = RunResult(p.returncode, out, err, run_dir, read_metrics(run_dir))
    res.pgid = p.pid  # type: ignore[attr-defined]  (start_new_session: the launcher leads its own group)
    res.killed_at = killed_at  # type: ignore[attr-defined]
    return res


def wait_group_gone(pgid: int, timeout: float = 30.0) -> bool:
    """True once no process of group `pgid` is left (ranks do not outlive a killed launcher)."""
    import time

    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file under `run_dir` with its size and mtime: equal before and after = nothing was written."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def one_error_line(r: RunResult, rc: int = 2) -> str:
    """The job's single `error:` line (exit status `rc`, no traceback, nothing trained)."""
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == rc and len(lines) == 1, r.tail()
    assert "Traceback" not in r.stderr and "step 1/" not in r.stdout, r.tail()
    return lines[0]
