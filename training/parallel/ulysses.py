"""Ulysses sequence parallelism on DeepSpeed's groups and all-to-all: the implementation of model/sequence.py's seam.

Groups: `deepspeed.runtime.sequence_parallel.parallel_state_sp` (the mpu DeepSpeed's ALST/Ulysses uses) builds the
sequence-parallel groups of `sp_size` consecutive ranks and the sequence-data-parallel group (all ranks). Passed to
`deepspeed.initialize(mpu=...)`, the engine then (0.19.8, relied on here):
  * reduces dense gradients over the sequence-data-parallel group and divides them by world / sp_size
    (`engine._reduce_non_expert_gradients`, stage_1_and_2 `average_tensor`): every rank's gradient is a partial
    sum of its sequence's loss, so the trainer scales each rank's loss by the data-parallel size world / sp_size;
    ZeRO-3's reduce-scatter path (`stage3.__avg_scatter_grads`, taken whenever `reduce_scatter` is on, its
    default) divides by the whole partition group instead (only its all-reduce path applies the SP factor), so
    under ZeRO-3 the trainer scales by the world size (`gradient_averaging_ranks`);
  * partitions ZeRO-1/2 optimizer state over the sequence-data-parallel group (`seq_data_parallel_group`);
  * sizes the batch by world / sp_size data-parallel ranks (`DeepSpeedConfig` world_size from the mpu).
The exchange is `deepspeed.sequence.layer._SeqAllToAll` (scatter heads, gather tokens, batch first; its backward is
the inverse exchange), the one DeepSpeed's `DistributedAttention` uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

HEAD_DIM, TOKEN_DIM, BATCH_DIM = 2, 1, 0  # [B, T, H, X]


@dataclass
class UlyssesShard:
    """model.sequence.SequenceShard over one sequence-parallel process group."""

    group: Any
    size: int
    rank: int
    exchange: Any  # deepspeed.sequence.layer._SeqAllToAll (imported with DeepSpeed, in `ulysses_shard`)

    def to_head_shard(self, x_BtHX: torch.Tensor) -> torch.Tensor:
        return self.exchange.apply(self.group, x_BtHX.contiguous(), HEAD_DIM, TOKEN_DIM, BATCH_DIM)

    def to_token_shard(self, x_BThX: torch.Tensor) -> torch.Tensor:
        return self.exchange.apply(self.group, x_BThX.contiguous(), TOKEN_DIM, HEAD_DIM, BATCH_DIM)


def gradient_averaging_ranks(world_size: int, sp_size: int, zero_stage: int) -> int:
    """What DeepSpeed divides the summed gradients by (module docstring): the trainer multiplies each rank's loss
    by it so the update is the global-batch token mean for any layout."""
    return world_size if zero_stage == 3 else world_size // sp_size


def sequence_groups(sp_size: int):
    """DeepSpeed's sequence-parallel mpu with its groups created (once per process): pass it to
    deepspeed.initialize(mpu=...) and to `UlyssesShard`."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(sp_size)
    return mpu


def ulysses_shard(sp_size: int) -> tuple[UlyssesShard, Any]:
    """(this rank's shard, DeepSpeed's mpu) for `parallel.sp_size`; needs the process group."""
    if not dist.is_initialized():
        raise RuntimeError("sequence parallelism needs an initialised process group; call deepspeed.init_distributed()")
    from deepspeed.sequence.layer import _SeqAllToAll

    mpu = sequence_groups(sp_size)
    size, rank = mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank()
    return UlyssesShard(mpu.get_sequence_parallel_group(), size, rank, _SeqAllToAll), mpu
