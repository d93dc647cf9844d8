"""The sequence-sharding seam (docs/model.md §13): how a mixer sees the whole sequence when its tokens are split
over ranks (Ulysses sequence parallelism).

Every part of K3 except the sequence mixers is token-wise, so under sequence parallelism each rank runs it on its
own T/N tokens. KDA's short convolution and chunked recurrence and MLA's causal attention need every token of a
document, but their heads are independent: an all-to-all from "T/N tokens x all H heads" to "all T tokens x H/N
heads" lets each rank run the exact full-sequence algorithm for its head group, and the inverse all-to-all brings
the outputs back to the token shards. `model/` only states the contract; `training/parallel/ulysses.py` implements
it on the sequence-parallel process group.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SequenceShard(Protocol):
    """A rank's view of one sequence split into `size` equal, contiguous token shards; this rank holds shard
    `rank` (tokens [rank*T/size, (rank+1)*T/size)) and, inside the mixers, head group `rank`."""

    size: int
    rank: int

    def to_head_shard(self, x_BtHX: torch.Tensor) -> torch.Tensor:
        """[B, T/N, H, X] (my tokens, all heads) -> [B, T, H/N, X] (all tokens in order, my heads); differentiable."""
        ...

    def to_token_shard(self, x_BThX: torch.Tensor) -> torch.Tensor:
        """The inverse: [B, T, H/N, X] -> [B, T/N, H, X]; differentiable."""
        ...


def head_slice(shard: SequenceShard, num_heads: int) -> slice:
    """The heads this rank's mixer owns between the two all-to-alls."""
    if num_heads % shard.size:
        raise ValueError(f"{num_heads} heads cannot be split over sequence-parallel size {shard.size}")
    per = num_heads // shard.size
    return slice(shard.rank * per, (shard.rank + 1) * per)


def gather_shared(shard: SequenceShard, x_BtX: torch.Tensor) -> torch.Tensor:
    """All tokens of a head-shared stream (MLA's latent): [B, T/N, X] -> [B, T, X] on every rank.

    One copy per destination as a "head" axis, then the head all-to-all: an all-gather whose backward (the reverse
    all-to-all, then the sum over the copies) is the reduce-scatter, with no collective but the seam's.
    """
    B, t, X = x_BtX.shape
    copies_BtNX = x_BtX.unsqueeze(2).expand(B, t, shard.size, X).contiguous()
    return shard.to_head_shard(copies_BtNX).squeeze(2)  # [B, T, 1, X] -> [B, T, X]
