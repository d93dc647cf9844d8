"""MTP under sequence parallelism (model/mtp.py halo, training/step.py MicroBatch.objective), in one process: N
threads each run one token shard of the float64 micro model through a real all-to-all between the threads (the
seam contract of model/sequence.py, `_SeqAllToAll`'s semantics), and the shards' objectives and gradients add up to
the whole sequence's."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from model.k3 import IGNORE_INDEX, K3ForCausalLM
from tests.model.micro import exercise_every_path, micro_config
from training.step import pack_microbatch


class _Hub:
    """What the ranks of one sequence-parallel group exchange: one slot per rank and a barrier."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=120)

    def all_to_all(self, rank: int, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        self.slots[rank] = x.chunk(self.size, scatter_dim)  # type: ignore[call-overload]
        self.barrier.wait()
        out = torch.cat([self.slots[s][rank] for s in range(self.size)], gather_dim)  # type: ignore[index]
        self.barrier.wait()  # every rank has read its chunks before the slots are reused
        return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hub, rank, x, scatter_dim, gather_dim):
        ctx.args = hub, rank, scatter_dim, gather_dim
        return hub.all_to_all(rank, x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        hub, rank, scatter_dim, gather_dim = ctx.args
        return None, None, hub.all_to_all(rank, grad.contiguous(), gather_dim, scatter_dim), None, None


class ThreadShard:
    """model.sequence.SequenceShard between threads: heads scattered (dim 2), tokens gathered (dim 1)."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.size, self.rank = hub, hub.size, rank

    def to_head_shard(self, x_BtHX: torch.Tensor) -> torch.Tensor:
        return _Exchange.apply(self.hub, self.rank, x_BtHX.contiguous(), 2, 1)

    def to_token_shard(self, x_BThX: torch.Tensor) -> torch.Tensor:
        return _Exchange.apply(self.hub, self.rank, x_BThX.contiguous(), 1, 2)


def test_sharded_mtp_objective_and_gradients_equal_the_whole_sequence_in_float64():
    """2 shards of 12 tokens, documents [0, 9), [9, 17), [17, 24): one spans the shard edge; depth 2; a -100."""
    torch.manual_seed(0)
    ref = exercise_every_path(K3ForCausalLM(micro_config(mtp_depth=2)).double())
    T, D, N = 24, 2, 2
    ids = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 11] = IGNORE_INDEX  # position 10's main target, and depth k's at 10 - k (across the edge for k=2)
    cu = torch.tensor([0, 9, 17, T])
    whole = ref(ids, labels=labels, cu_seqlens=cu)
    (whole.loss * whole.num_loss_tokens).backward()  # the trainer's 1-rank objective at scale 1

    hub = _Hub(N)
    shards = [copy.deepcopy(ref) for _ in range(N)]

    def run(r: int) -> torch.Tensor:
        model = shards[r]
        model.zero_grad(set_to_none=True)
        model.set_sequence_shard(ThreadShard(hub, r))
        mb = pack_microbatch({"input_ids": ids, "labels": labels, "cu_seqlens": cu}, N, r, None, D)
        out = model(**mb.model_inputs(torch.device("cpu")))
        objective = mb.objective(out, model.mtp_weight, 1.0)
        objective.backward()
        return objective.detach()

    with ThreadPoolExecutor(N) as pool:
        objectives = list(pool.map(run, range(N)))
    assert torch.allclose(sum(objectives), (whole.loss * whole.num_loss_tokens).detach(), rtol=1e-12, atol=0)
    worst, scale = 0.0, 0.0
    for name, p in ref.named_parameters():
        grads = [dict(m.named_parameters())[name].grad for m in shards]
        got = sum(torch.zeros_like(p) if g is None else g for g in grads)
        want = torch.zeros_like(p) if p.grad is None else p.grad
        worst, scale = max(worst, float((got - want).abs().max())), max(scale, float(want.abs().max()))
    eh = ref.model.layers[5].eh_proj.weight.grad
    assert eh is not None and eh.abs().max() > 0
    assert worst < 1e-11 * scale, (worst, scale)
