"""Expert parallelism inside a real DeepSpeed engine (ZeRO-2, gloo, client AdamW, grad clipping on).

A small LM built from the real LatentMoE (tests/distributed/ep_engine_worker.py; layer 0 balanced by QB biases,
layer 1 by the auxiliary loss) trains 6 steps on the same global
batches in three layouts -- EP=2 on 2 ranks, EP=1 DP=2 GA=1 on 2 ranks, EP=1 DP=1 GA=2 on 1 rank -- and the EP=2
checkpoint is loaded at EP=1. Runs start concurrently (module fixture); each test checks one property.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.launch import free_port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("ep_engine_worker.py")
REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _start(out: Path, nproc: int, *args: str) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for r in range(nproc):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            DS_ACCELERATOR="cpu",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out), *args],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _finish(out: Path, procs: list[subprocess.Popen]) -> list[dict]:
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(len(procs))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("ep_engine")
    # args: ep_size micro_rows grad_accum steps [mode]
    started = {
        "ep2": _start(root / "ep2", 2, "2", "2", "1", str(STEPS), "save"),
        "dp2_ga1": _start(root / "dp2_ga1", 2, "1", "2", "1", str(STEPS)),
        "dp1_ga2": _start(root / "dp1_ga2", 1, "1", "2", "2", str(STEPS)),
    }
    out = {name: _finish(root / name, procs) for name, procs in started.items()}
    ckpt = root / "ep2" / "ckpt"
    out["ep1_from_ep2"] = _finish(root / "load", _start(root / "load", 1, "1", "4", "1", "0", f"load:{ckpt}"))
    out["ckpt_dir"] = ckpt / "ckpt"
    return out


def test_ep2_losses_match_ep1_within_1e_5_relative(runs):
    ep2, ep1 = torch.tensor(runs["ep2"][0]["losses"]), torch.tensor(runs["dp1_ga2"][0]["losses"])
    assert len(ep2) == STEPS
    torch.testing.assert_close(ep2, ep1, rtol=1e-5, atol=0)


def test_ep2_balancing_biases_match_ep1(runs):
    torch.testing.assert_close(runs["ep2"][0]["biases"], runs["dp1_ga2"][0]["biases"], rtol=0, atol=1e-6)
    assert runs["ep2"][0]["biases"].abs().max() > 0  # the balancer did move the biases


def test_balancing_biases_are_bitwise_identical_on_every_rank(runs):
    for name in ("ep2", "dp2_ga1"):
        assert torch.equal(runs[name][0]["biases"], runs[name][1]["biases"]), name


def test_global_router_counts_are_identical_across_layouts(runs):
    ref = runs["dp1_ga2"][0]["counts"]  # [steps, layers, E]
    assert ref.sum() > 0
    for name in ("ep2", "dp2_ga1"):
        for rank_result in runs[name]:
            assert torch.equal(rank_result["counts"], ref), name


@pytest.mark.parametrize("name", ["ep2", "dp2_ga1"])
def test_aux_losses_match_dp1_ga2(runs, name):
    aux, ref = torch.tensor(runs[name][0]["aux"]), torch.tensor(runs["dp1_ga2"][0]["aux"])
    assert ref.abs().min() > 0
    torch.testing.assert_close(aux, ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["ep2", "dp2_ga1"])
def test_trained_weights_incl_aux_trained_router_match_dp1_ga2(runs, name):
    # the router of the aux-balanced layer learns from the aux-loss gradient: equal weights => equal gradients
    full, ref = runs[name][0]["full_state"], runs["dp1_ga2"][0]["full_state"]
    for k in ref:
        torch.testing.assert_close(full[k], ref[k], rtol=1e-4, atol=2e-5)


def test_dp2_ga1_matches_dp1_ga2(runs):
    a, b = runs["dp2_ga1"][0], runs["dp1_ga2"][0]
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(a["biases"], b["biases"], rtol=0, atol=1e-6)


def test_checkpoint_stores_one_file_per_layer_and_global_expert(runs):
    files = glob.glob(os.path.join(runs["ckpt_dir"], "layer_*_expert_*_mp_rank_00_model_states.pt"))
    assert len(files) == 2 * 8  # 2 MoE layers x 8 experts, whatever the EP size


def test_ep2_checkpoint_loads_at_ep1_with_identical_outputs(runs):
    loaded = runs["ep1_from_ep2"][0]
    assert loaded["same_layout"] is False
    assert torch.equal(loaded["probe_logits"], runs["ep2"][0]["probe_logits"])


def test_full_state_dict_is_the_same_whatever_the_ep_size(runs):
    a, b = runs["ep2"][0]["full_state"], runs["ep1_from_ep2"][0]["full_state"]
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(runs["ep2"][1]["full_state"]["moes.0.experts.w1"], a["moes.0.experts.w1"])


def test_consolidated_checkpoint_equals_the_gathered_full_state(runs):
    from training.parallel.ds_moe import consolidated_module_state

    full = runs["ep2"][0]["full_state"]
    cons = consolidated_module_state(runs["ckpt_dir"])
    assert sorted(cons) == sorted(full)
    assert all(torch.equal(cons[k], full[k]) for k in full)
