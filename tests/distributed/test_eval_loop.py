"""Held-out evaluation in the loop and on a checkpoint (training/eval/), on the session's EP=2 job (ep2_ref).

- The EP=2 job with `eval.every=2`, killed after step 5 and resumed, has bitwise the training losses of the same job
  without evaluation (ep2_ref): evaluation moves no weight, router bias, RNG, data position or optimizer state.
- `python -m training.evaluate` on ep2_ref's last checkpoint gives the same held-out loss, choice accuracies and
  passkey log-probability on 1 rank, 2 ranks EP=2 ZeRO-3 and 2 ranks SP=2 (within 1e-6 relative), and the loop's
  held-out loss at step 8 (the same weights: the losses above are bitwise equal) is that value too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed.conftest import EP2_JOB, REPO, job_env, run_training
from training.launch import launch_command

pytestmark = pytest.mark.distributed

EVAL = ["eval=heldout", "eval.every=2", "eval.sets.0.rows=8"]
SET = ["eval=heldout", "eval.sets.0.rows=8"]
MC = [  # HellaSwag-format items short enough for the job's 64-token rows
    {"ctx": "def add(a, b):", "endings": ["return a + b", "import os", "pass"], "label": 0},
    {"ctx_a": "for i in", "ctx_b": "range(10):", "endings": ["print(i)", "class A:", "else"], "label": "0"},
    {"ctx": "import", "activity_label": "python", "endings": ["os", "sys", "json", "re"], "label": 1},
]


@pytest.fixture(scope="module")
def eval_job(runs_root):
    run_dir = runs_root / "ep2_eval"
    killed = run_training(run_dir, EP2_JOB + EVAL, nproc=2, env={"K3_FAULT_KILL_AT_STEP": "5", "K3_FAULT_RANK": "0"})
    assert killed.returncode != 0
    return run_training(run_dir, EP2_JOB + EVAL, nproc=2)


def _evaluate(ckpt, out, extra: list[str], nproc: int) -> dict:
    mc = out.parent / "mc.jsonl"
    mc.write_text("".join(json.dumps(r) + "\n" for r in MC))
    tasks = f"[{{type: choice, name: mc, path: {mc}}}, {{type: passkey, name: pk, lengths: [64], samples: 1}}]"
    args = [f"checkpoint={ckpt}", f"out={out}", *SET, f"eval.tasks={tasks}", *extra]
    cmd = (
        [sys.executable, "-m", "training.evaluate", *args]
        if nproc == 1
        else launch_command(args, nproc, "training/evaluate.py")
    )
    p = subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def test_training_with_eval_every_2_killed_and_resumed_has_bitwise_the_losses_without_eval(eval_job, ep2_ref):
    assert eval_job.returncode == 0, eval_job.tail()
    assert eval_job.losses() == ep2_ref.losses()  # every step, exact float equality
    evals = [r for r in eval_job.metrics if "eval/heldout/loss" in r]
    assert sorted({r["step"] for r in evals}) == [2, 4, 6, 8]
    for r in evals:
        assert r["tokens_seen"] == r["step"] * 4 * 64  # training tokens so far (global batch 4 rows x 64)
        assert {"eval/heldout/ppl", "eval/heldout/bpb", "eval/heldout/time_s"} <= set(r)
        assert any(k.startswith("eval/heldout/loss_pos/") for k in r)
    summary = json.loads((eval_job.run_dir / "summary.json").read_text())
    assert summary["best/eval/heldout/loss"] == min(r["eval/heldout/loss"] for r in evals)


def test_checkpoint_evaluation_is_the_same_on_1_rank_ep2_zero3_and_sp2_and_in_the_loop(ep2_ref, eval_job, runs_root):
    ckpt = ep2_ref.run_dir
    one = _evaluate(ckpt, runs_root / "eval_1.json", [], 1)
    ep = _evaluate(ckpt, runs_root / "eval_ep2z3.json", ["parallel=ep2", "deepspeed=zero3"], 2)
    sp = _evaluate(ckpt, runs_root / "eval_sp2.json", ["parallel=sp2"], 2)
    for other in (ep, sp):  # held-out loss, choice accuracies, the passkey key's log-probability (a sum)
        assert other["heldout"]["loss"] == pytest.approx(one["heldout"]["loss"], rel=1e-6, abs=0)
        assert (other["mc"]["acc"], other["mc"]["acc_norm"]) == (one["mc"]["acc"], one["mc"]["acc_norm"])
        assert other["pk"]["logprob@64"] == pytest.approx(one["pk"]["logprob@64"], rel=1e-6, abs=0)
    loop = [r["eval/heldout/loss"] for r in eval_job.metrics if r.get("step") == 8 and "eval/heldout/loss" in r][-1]
    assert loop == pytest.approx(one["heldout"]["loss"], rel=1e-6, abs=0)
