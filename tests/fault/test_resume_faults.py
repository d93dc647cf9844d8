"""Fault 3: resume twice in a row, and resume after the data source looped: the job continues without repeating
or skipping data (losses equal the uninterrupted job's bitwise). World size 2 -> 1 is in test_kill.py."""

from __future__ import annotations

import json

import pytest

from tests.fault.conftest import TINY, must_succeed, record, run_training

N_DOCS, STEPS = 30, 10


@pytest.fixture(scope="module")
def small_corpus(runs_root, tokenizer_path):
    """30 short documents: the source loops (a new epoch) every few steps."""
    path = runs_root / "small.jsonl"
    path.write_text(
        "".join(
            json.dumps({"text": f"document {i} " + "lorem ipsum dolor sit amet " * 4}) + "\n" for i in range(N_DOCS)
        )
    )
    return [
        *TINY,
        f"train.steps={STEPS}",
        "checkpoint.every=2",
        "checkpoint.keep_last=3",
        f"data.sources=[{{type: jsonl, path: {path}}}]",
        f"data.tokenizer.model_path={tokenizer_path}",
    ]


@pytest.mark.fault_matrix
def test_resume_twice_across_a_data_loop_is_bitwise(runs_root, small_corpus):
    ref = must_succeed(run_training(runs_root / "loop_ref", small_corpus, launcher=False))
    reads = {r["step"]: r["data/records_read"] for r in ref.metrics}
    assert reads[8] > 2 * N_DOCS  # the source looped (several epochs) before the checkpoint of step 8
    run_dir = runs_root / "loop_resumed"
    k1 = run_training(run_dir, small_corpus, launcher=False, env={"K3_FAULT_KILL_AT_STEP": "3"})
    k2 = run_training(run_dir, small_corpus, launcher=False, env={"K3_FAULT_KILL_AT_STEP": "9"})
    final = run_training(run_dir, small_corpus, launcher=False)
    same = final.returncode == 0 and final.losses() == ref.losses()
    record("resume twice, across a data loop", survived=final.returncode == 0, data_lost=not same)
    assert k1.returncode != 0 and k2.returncode != 0
    assert "resumed from" in k2.stdout and "resumed from" in final.stdout
    assert final.returncode == 0, final.tail()
    assert final.losses() == ref.losses()
    assert {r["step"]: r["data/records_read"] for r in final.metrics} == reads  # same data position every step
