"""DistStatsReducer over 2 gloo processes: sums all-reduce, variable-length cat all-gathers in rank order."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.distributed import DistStatsReducer
from training.launch import free_port
from training.step import pack_microbatch


def _worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        r = DistStatsReducer()
        s = r.sum(torch.tensor([1.0, rank + 1.0]))
        local = torch.arange(3 if rank == 0 else 5, dtype=torch.float64).reshape(-1, 1) + 10 * rank
        c = r.cat(local)
        empty = r.cat(torch.zeros((0, 2)) if rank == 0 else torch.ones((2, 2)))
        out[rank] = (s, c, empty)
    finally:
        dist.destroy_process_group()


def test_dist_stats_reducer_sum_and_variable_length_cat():
    port = free_port()
    with mp.Manager() as m:
        out = m.dict()
        mp.start_processes(_worker, args=(2, port, out), nprocs=2, start_method="fork")
        res = dict(out)
    whole = torch.cat([torch.arange(3, dtype=torch.float64), torch.arange(5, dtype=torch.float64) + 10]).reshape(-1, 1)
    for rank in (0, 1):
        s, c, empty = res[rank]
        torch.testing.assert_close(s, torch.tensor([2.0, 3.0]))
        assert torch.equal(c, whole)
        assert torch.equal(empty, torch.ones((2, 2)))


def test_targets_crossing_a_document_boundary_are_not_counted():
    mb = pack_microbatch(
        {
            "input_ids": torch.arange(10).reshape(1, -1),
            "labels": torch.arange(10).reshape(1, -1),
            "cu_seqlens": torch.tensor([0, 4, 7, 10]),
        }
    )
    assert mb.n_targets == 9 - 2  # targets 1..9 minus the two document starts
