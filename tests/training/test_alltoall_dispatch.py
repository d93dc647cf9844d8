"""All-to-all expert-parallel dispatcher == local dispatcher, on 2 real gloo ranks (spec: issue 6).

One 2-process run (module fixture) covers every routing case; each test checks one property of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.launch import free_port

WORKER = Path(__file__).with_name("ep_dispatch_worker.py")
REPO = Path(__file__).resolve().parents[2]
FP64_CASES = ["random_fp64", "skewed_fp64", "empty_rank_fp64", "empty_experts_fp64", "no_tokens_on_rank1_fp64"]
FP64_CASES += ["random_fp64_grouped", "empty_rank_fp64_grouped", "no_tokens_on_rank1_fp64_grouped"]  # grouped_mm


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("a2a")
    port = str(free_port())
    procs = []
    for r in range(2):
        env = dict(
            os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out)],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("case", FP64_CASES)
def test_alltoall_forward_equals_local_fp64(results, case):
    for r in range(2):
        assert results[r][case]["out"] < 1e-12, (r, results[r][case])


@pytest.mark.parametrize("case", FP64_CASES)
def test_alltoall_input_and_weight_gradients_equal_local_fp64(results, case):
    for r in range(2):
        assert results[r][case]["grad_z"] < 1e-12 and results[r][case]["grad_w"] < 1e-12, (r, results[r][case])


@pytest.mark.parametrize("case", FP64_CASES)
def test_alltoall_expert_gradients_equal_local_fp64(results, case):
    for r in range(2):
        assert results[r][case]["grad_experts"] < 1e-12, (r, results[r][case])


def test_alltoall_fp32_forward_is_bitwise_equal_to_local(results):
    for r in range(2):
        assert results[r]["random_fp32"]["bitwise_forward"] == 1.0, results[r]["random_fp32"]


def test_alltoall_fp32_gradients_are_bitwise_equal_to_local(results):
    for r in range(2):
        assert results[r]["random_fp32"]["bitwise_backward"] == 1.0, results[r]["random_fp32"]


def test_skewed_routing_drops_nothing(results):
    # rank 0 owns expert 0, which ~90% of the tokens pick: it must receive far more rows than it sends, yet match
    assert results[0]["skewed_fp64"]["bytes_sent"] > 0
    assert results[0]["skewed_fp64"]["out"] < 1e-12 and results[1]["skewed_fp64"]["out"] < 1e-12


def test_bytes_sent_are_latent_width_rows(results):
    # every (token, slot) row leaves once and its result comes back once, in the latent width (16 fp32 = 64 B)
    total = sum(results[r]["random_fp32"]["bytes_sent"] for r in range(2))
    rows = sum(results[r]["random_fp32"]["rows"] for r in range(2))
    assert total == rows * 2 * 16 * 4


def test_grouped_mm_backend_fp32_matches_the_local_loop(results):
    for r in range(2):
        res = results[r]["random_fp32_grouped"]
        assert res["out"] < 1e-6 and res["grad_z"] < 1e-6 and res["grad_w"] < 1e-6, (r, res)
        assert res["grad_experts"] < 1e-6, (r, res)


def test_expert_parallel_host_reads_are_the_split_sizes_only(results):
    """One exchange per MoE layer and direction: the send and receive split sizes are read on the host, nothing
    else (grouped_mm backend); the loop backend also reads its local experts' row counts."""
    for r in range(2):
        assert results[r]["random_fp32_grouped"]["syncs"] == {"tolist": 2}, results[r]["random_fp32_grouped"]
        assert results[r]["random_fp32"]["syncs"] == {"tolist": 3}, results[r]["random_fp32"]
