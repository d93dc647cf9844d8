"""MTP under ZeRO-3 + expert parallelism (issue 25): one launch pair, the tiny_ci model with mtp_depth=1 started
from one random HF checkpoint, global batch 4 rows, 4 steps.
  z3ep2  2 ranks deepspeed=zero3 parallel.ep_size=2 (micro 2, GA 1)
  sp2    2 ranks parallel=sp2 parallel.ep_size=2 deepspeed=zero2, micro 1 x GA 4: both ranks share the rows, each
         holds 32 of a row's 64 tokens (one document: the D-row halo crosses the shard edge inside it)
  z0     1 rank deepspeed=zero0, EP=1, GA=2: the reference
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.distributed.conftest import TINY, RunResult, must_succeed, run_training

pytestmark = pytest.mark.distributed
STEPS = 4
BASE = [*TINY, "model.mtp_depth=1", f"train.steps={STEPS}", "train.micro_batch_size=2", "checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def jobs(runs_root) -> dict[str, RunResult]:
    from model import K3ForCausalLM, save_hf_checkpoint
    from training.config import build_model_config, compose

    root = runs_root / "mtp"
    torch.manual_seed(5)
    model = K3ForCausalLM(build_model_config(compose(BASE)))
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.copy_(torch.randn_like(t) * 0.05)
    save_hf_checkpoint(model, root / "hf_init")
    init = f"model.init_from={root / 'hf_init'}"
    z3 = [*BASE, init, "deepspeed=zero3", "parallel.ep_size=2", "train.grad_accum=1"]
    sp2 = [*BASE, init, "parallel=sp2", "parallel.ep_size=2", "deepspeed=zero2"]
    sp2 += ["train.micro_batch_size=1", "train.grad_accum=4"]
    with ThreadPoolExecutor(3) as pool:
        ep2 = pool.submit(run_training, root / "z3ep2", z3, 2)
        sp = pool.submit(run_training, root / "sp2", sp2, 2)
        z0 = pool.submit(
            run_training, root / "z0", [*BASE, init, "deepspeed=zero0", "train.grad_accum=2"], 1, None, False
        )
        out = {"z3ep2": must_succeed(ep2.result()), "sp2": must_succeed(sp.result())}
        return {**out, "z0": must_succeed(z0.result())}


def _metric(run: RunResult, key: str) -> dict[int, float]:
    return {int(r["step"]): r[key] for r in run.metrics if key in r}


def _match_reference(run: RunResult, ref: RunResult) -> None:
    for key in ("loss", "loss/mtp_1", "grad_norm"):
        got, want = _metric(run, key), _metric(ref, key)
        assert sorted(got) == sorted(want) == list(range(1, STEPS + 1)), key
        for s in want:
            assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (key, s, got[s], want[s])


def test_mtp_zero3_ep2_losses_match_one_rank_zero0_within_1e_5(jobs):
    _match_reference(jobs["z3ep2"], jobs["z0"])


def test_mtp_sp2_ep2_losses_match_one_rank_zero0_within_1e_5(jobs):
    _match_reference(jobs["sp2"], jobs["z0"])


def test_mtp_block_router_metrics_are_logged(jobs):
    last = jobs["z3ep2"].metrics[-1]  # tiny_ci: L = 2, so the MTP block is MoE layer 2
    assert "router/layer2/maxvio" in last and last["router/layer2/max_load"] > 0
