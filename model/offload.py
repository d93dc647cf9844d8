"""Activation checkpoints on the host: a checkpointed decoder layer whose saved inputs live in host memory.

With `train.activation_checkpointing=true` each layer keeps only its inputs (the residual stream `partial` and, with
Block AttnRes, the completed blocks) from forward to backward, on the device: at 1M context that is L x T/S x d per
GPU. `checkpoint_on_host` copies those inputs to (pinned) host memory as the layer runs; the non-reentrant
checkpoint then holds only the host copies, and its recompute in backward copies them back. The device inputs are
freed as soon as the forward no longer needs them. Each tensor is copied once per forward (`copies`, keyed by the
tensor): a completed block read by every later layer has one host copy, which the later layers share, and its
gradient flows back through that one copy. The values are the same tensors moved: gradients are bitwise those of
device-resident checkpoints.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


class _ToHost(torch.autograd.Function):
    """x -> a host copy (pinned on CUDA); backward moves the gradient back to x's device."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.device = x.device
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
        out.copy_(x, non_blocking=x.is_cuda)  # stream-ordered before any later copy back
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.to(ctx.device, non_blocking=True)


HostCopies = dict[int, tuple[weakref.ref, torch.Tensor]]  # id(device tensor) -> (weak ref to it, host copy)


def _host(x: torch.Tensor, copies: HostCopies) -> torch.Tensor:
    """The host copy of x made earlier in this forward (of x itself, or of the block a layer rebuilt x from).
    The device tensor is held weakly: the copies never keep it alive."""
    hit = copies.get(id(x))
    if hit is not None and hit[0]() is x:
        return hit[1]
    h = _ToHost.apply(x)
    copies[id(x)] = (weakref.ref(x), h)
    return h


def checkpoint_on_host(
    fn: Callable[..., tuple[list[torch.Tensor], torch.Tensor, Any]],
    blocks: list[torch.Tensor],
    partial: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    copies: HostCopies,
) -> tuple[list[torch.Tensor], torch.Tensor, Any]:
    """fn(blocks, partial, cu_seqlens, None) under a non-reentrant checkpoint whose saved inputs are host copies.
    `copies`: one dict per model forward (K3Model.forward), shared by its layers; only the forward run records in
    it (the recompute in backward must not keep its device tensors), and the checkpoint does not keep it."""
    device = partial.device
    blocks_h = [_host(b, copies) for b in blocks]
    partial_h = _host(partial, copies)
    first_run: dict[str, HostCopies] = {"copies": copies}

    def run(partial_h: torch.Tensor, cu: torch.Tensor | None, *blocks_h: torch.Tensor):
        blocks_d = [b.to(device, non_blocking=True) for b in blocks_h]
        out_blocks, out_partial, stats = fn(blocks_d, partial_h.to(device, non_blocking=True), cu, None)
        record = first_run.pop("copies", None)
        if record is not None:
            for b_d, b_h in zip(blocks_d, blocks_h):  # a later layer reading this block reuses its host copy
                record[id(b_d)] = (weakref.ref(b_d), b_h)
        return out_blocks, out_partial, stats

    return checkpoint(run, partial_h, cu_seqlens, *blocks_h, use_reentrant=False)
