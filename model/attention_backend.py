"""Softmax attention over packed documents: which kernel runs, chosen in one place (`packed_backend`).

A packed row holds several documents (`cu_seqlens = [0, l0, l0+l1, ..., T]`); each token attends causally within its
own document. Two backends, equal in value:

* `per_document` (CPU): one causal fused-SDPA call per document. It needs the boundaries as Python ints
  (`cu_seqlens_host`, read once per micro-batch by the model) and no [T, T] mask; on CPU, where FlexAttention has a
  forward only (its backward raises NotImplementedError in torch 2.13), it is the training path.
* `flex` (CUDA): one `flex_attention` call over the whole row with a document block mask built from the device
  `cu_seqlens` alone (`document_block_mask`: no host read, no [T, T] tensor; O((T/128)^2) block flags), compiled
  with `torch.compile` so the fused Triton kernel runs; qk head dim may differ from v's (192 vs 128 in K3).

`K3_PACKED_ATTENTION=per_document|flex` overrides the choice (benchmarks and tests compare the two in one run).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, cast

import torch

FLEX_BLOCK = 128  # flex_attention's default sparse block size (_DEFAULT_SPARSE_BLOCK_SIZE)
BACKENDS = ("per_document", "flex")


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def packed_backend(device: torch.device) -> str:
    """`flex` on CUDA (one kernel for all documents, no host read), `per_document` elsewhere (CPU training needs
    a backward, which CPU FlexAttention lacks); `K3_PACKED_ATTENTION` overrides."""
    forced = os.environ.get("K3_PACKED_ATTENTION", "")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"K3_PACKED_ATTENTION={forced!r}: choose one of {', '.join(BACKENDS)} (or unset it)")
        return forced
    return "flex" if device.type == "cuda" and flex_available() else "per_document"


def _segments_padded(cu_seqlens: torch.Tensor, total_len: int, padded_len: int) -> torch.Tensor:
    """Document id of every position [padded_len] int32 (device ops only); padding positions get id -1."""
    pos = torch.arange(padded_len, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens[1:].to(torch.int64), pos, right=True)
    return torch.where(pos < total_len, seg, -1).to(torch.int32)


def document_block_mask(cu_seqlens: torch.Tensor, total_len: int, block: int = FLEX_BLOCK):
    """FlexAttention BlockMask for causal attention within documents, from the device `cu_seqlens` alone.

    Block flags come from each block's first and last document id (ids rise along the row): a key block j <= query
    block i holds an allowed pair iff the last id of j >= the first id of i; it is full (no mask_mod needed) iff
    j < i and both blocks lie in one document. Memory O((T/block)^2), device ops only (no `.item()`/`.tolist()`),
    the same BlockMask as `create_block_mask(mask_mod, ...)` without its dense [T, T] evaluation.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = -(-total_len // block)
    seg_P = _segments_padded(cu_seqlens, total_len, n * block)  # [n * block]
    blocks_NB = seg_P.view(n, block)
    first_N = blocks_NB[:, 0]
    last_N = torch.where(blocks_NB >= 0, blocks_NB, torch.iinfo(torch.int32).min).amax(dim=1)  # pad ids are -1
    idx = torch.arange(n, device=cu_seqlens.device)
    lower_NN = idx[None, :] <= idx[:, None]  # key block j <= query block i
    any_NN = lower_NN & (last_N[None, :] >= first_N[:, None])
    whole_N = (blocks_NB >= 0).all(dim=1)  # no padding in the block
    one_doc_NN = (first_N[None, :] == last_N[:, None]) & whole_N[None, :] & whole_N[:, None]
    full_NN = (idx[None, :] < idx[:, None]) & one_doc_NN  # strictly below the diagonal, one document throughout
    partial_NN = any_NN & ~full_NN

    def ordered(flags_NN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = flags_NN.sum(dim=-1).to(torch.int32)[None, None]  # [1, 1, n]
        order = torch.argsort(flags_NN.to(torch.int8), dim=-1, descending=True, stable=True)
        return num, order.to(torch.int32)[None, None]  # [1, 1, n, n]

    def doc_causal(b, h, q_idx, kv_idx):
        return (seg_P[q_idx] == seg_P[kv_idx]) & (kv_idx <= q_idx)

    kv_num, kv_idx = ordered(partial_NN)
    full_num, full_idx = ordered(full_NN)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=doc_causal, seq_lengths=(total_len, total_len)
    )


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(
    q_BHTE: torch.Tensor,
    k_BHTE: torch.Tensor,
    v_BHTV: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    compiled: bool | None = None,
) -> torch.Tensor:
    """Causal attention within each document of one packed row, one FlexAttention call: [B, H, T, V].

    `compiled` defaults to True on CUDA (the fused kernel; eager flex materialises the scores), False elsewhere
    (CPU: the eager forward, for checking values against the per-document path)."""
    from torch.nn.attention.flex_attention import flex_attention

    T = q_BHTE.shape[2]
    mask = document_block_mask(cu_seqlens.to(q_BHTE.device), T)
    use_compiled = q_BHTE.device.type == "cuda" if compiled is None else compiled
    fn = _compiled_flex() if use_compiled else cast(Callable[..., Any], flex_attention)
    return fn(q_BHTE, k_BHTE, v_BHTV, block_mask=mask, scale=scale)
