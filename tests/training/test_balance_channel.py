"""One channel for routing statistics: a step's micro-batches merge, reduce once over 2 real gloo ranks, and the
balancers then set exactly the bias one process computes for the whole global batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.config import K3Config
from model.moe.balance import Balancer
from model.moe.layer import RouterStats
from model.moe.router import Router, select_experts
from training.balance import StepRouting, counts_LE
from training.distributed import DistStatsReducer
from training.launch import free_port

E, K, LAYERS = 8, 2, 2


def _balancers(estimator: str) -> list[Balancer]:
    cfg = K3Config.preset(
        "tiny", hidden_size=32, num_experts=E, num_experts_per_token=K, moe_balance_estimator=estimator
    )
    return [Balancer(cfg, Router(cfg)) for _ in range(LAYERS)]


def _scores(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(n, E, dtype=torch.float64, generator=g) + torch.arange(E) * -0.3)


def _route(bals: list[Balancer], parts: list[torch.Tensor], reducer) -> tuple[list[torch.Tensor], torch.Tensor]:
    routing = StepRouting()
    for scores in parts:  # micro-batches: every layer sees the same tokens
        routing.add(
            [
                RouterStats(b.observe(scores, select_experts(scores, b.bias, K)[0]), None, len(scores), i)
                for i, b in enumerate(bals)
            ]
        )
    stats = routing.reduce_global(reducer)
    for b, s in zip(bals, stats):
        b.update(s)
    return [b.bias.clone() for b in bals], counts_LE(stats)


class _Local:
    def sum(self, t):
        return t

    def cat(self, t):
        return t


def _worker(rank: int, port: int, estimator: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        whole = _scores(0, 300)
        parts = [whole[:70], whole[70:120]] if rank == 0 else [whole[120:]]  # DP=2, GA=2 on rank 0
        out[rank] = _route(_balancers(estimator), parts, DistStatsReducer())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("estimator", ["exact", "histogram"])
def test_two_rank_reduced_statistics_give_the_one_process_bias_and_counts(estimator):
    port = free_port()
    with mp.Manager() as m:
        out = m.dict()
        mp.start_processes(_worker, args=(port, estimator, out), nprocs=2, start_method="fork")
        res = dict(out)
    ref_biases, ref_counts = _route(_balancers(estimator), [_scores(0, 300)], _Local())
    for rank in (0, 1):
        biases, counts = res[rank]
        assert torch.equal(counts, ref_counts) and int(counts.sum()) == LAYERS * 300 * K
        for b, r in zip(biases, ref_biases):
            assert torch.equal(b, r)
