"""Supervised fine-tuning from an HF checkpoint (issue 15's example, end to end): experiment=sft_tiny_base is
exported and fine-tuned with experiment=sft_tiny; the checkpoint brings its tiktoken tokenizer, loss is taken on
assistant tokens only and falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SFT_STEPS = 12


def _train(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "training.train", "logging.mode=disabled", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def base_hf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    p = _train("experiment=sft_tiny_base", "train.steps=4", f"run_dir={root / 'base'}")
    assert p.returncode == 0, p.stderr[-3000:]
    from training.tools.export import export_checkpoint

    return Path(export_checkpoint(str(root / "base"), str(root / "base-hf")))


@pytest.fixture(scope="module")
def sft_run(base_hf) -> Path:
    run_dir = base_hf.parent / "sft"
    p = _train(
        "experiment=sft_tiny",
        f"model.init_from={base_hf}",
        f"train.steps={SFT_STEPS}",
        "logging.every=1",
        f"run_dir={run_dir}",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_export_carries_the_tiktoken_tokenizer(base_hf):
    assert (base_hf / "tiktoken.model").is_file() and (base_hf / "tokenizer_config.json").is_file()


def test_fine_tuning_uses_the_checkpoints_tokenizer_everywhere(base_hf, sft_run):
    ranks = (base_hf / "tiktoken.model").read_bytes()
    assert (sft_run / "tiktoken.model").read_bytes() == ranks
    for step_dir in (sft_run / "checkpoints").glob("step_*"):
        assert (step_dir / "tiktoken.model").read_bytes() == ranks


def test_loss_is_taken_on_assistant_tokens_only_and_falls(sft_run):
    recs = _records(sft_run)
    frac = [r["data/loss_token_fraction"] for r in recs]
    assert all(0.05 < f < 0.9 for f in frac)  # the user/system text and markers carry no loss
    losses = [r["loss"] for r in recs]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5


def test_loss_on_all_takes_more_tokens(base_hf, tmp_path):
    p = _train(
        "experiment=sft_tiny",
        f"model.init_from={base_hf}",
        "train.steps=1",
        "train.loss_on=all",
        f"run_dir={tmp_path / 'all'}",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert _records(tmp_path / "all")[0]["data/loss_token_fraction"] > 0.9


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.vocab_size=256", "ids but the model has vocab_size=256"),
        ("data.tokenizer.type=sentencepiece", "data.tokenizer.type=sentencepiece"),
    ],
)
def test_a_tokenizer_that_does_not_fit_the_checkpoint_is_one_line(base_hf, tmp_path, override, needle):
    p = _train("experiment=sft_tiny", f"model.init_from={base_hf}", override, f"run_dir={tmp_path / 'bad'}")
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and needle in errors[0], p.stderr[-2000:]
    assert not (tmp_path / "bad" / "config.yaml").exists()
