"""Sequence-tiled chunked KDA for training (`train.mixer_tile_tokens`, K3ForCausalLM.set_mixer_tiling).

The chunked kernel is a scan over chunks carrying the recurrent state S [B, H, K, V]. `tiled_chunk_kda` runs the
same scan over tiles of `tile` tokens: each tile calls `chunk_kda` under its own non-reentrant checkpoint with the
previous tile's final state as its initial state, so backward keeps only the tile inputs (views of the mixer's
q, k, v, g, beta, which the layer keeps anyway) and one boundary state per tile, and recomputes one tile's chunk
tensors (~30 [T, H*K]-sized tensors untiled) at a time. Packed documents (`cu_seqlens`, B = 1) are cut at the tile
edges: the document crossing an edge continues from the carried state, every document starting inside a tile
starts from zero. Every chunk is computed by the same maths as untiled (chunks align with the tiles when `tile` is
a multiple of the chunk size and documents start on chunk boundaries; otherwise only the chunk grid moves): the
values agree to rounding.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from model.kda.ops import chunk_kda


def tile_segments(cu: list[int], a: int, b: int) -> tuple[list[int], bool]:
    """Cumulative lengths (from 0) of the document pieces inside tokens [a, b), and whether the first piece
    continues a document that started before a."""
    inner = [c - a for c in cu if a < c < b]
    return [0, *inner, b - a], a not in cu


def _tile(q, k, v, g, beta, S0, cu_local, scale, chunk_size):
    cu = None if cu_local is None else torch.tensor(cu_local, device=q.device)
    o, S = chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=S0,
        output_final_state=True,
        cu_seqlens=cu,
        chunk_size=chunk_size,
    )
    return o, S if cu is None else S[-1:]


def tiled_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    tile: int,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
) -> torch.Tensor:
    """`chunk_kda(q, k, v, g, beta, cu_seqlens=..., chunk_size=...)[0]` (zero initial state) computed over tiles of
    `tile` tokens, each recomputed in backward on its own (module docstring). Returns o [B, T, H, V]."""
    if tile <= 0:
        raise ValueError(f"mixer tiling needs tile > 0 tokens, got {tile}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu = None if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    carry = None  # the state entering the next tile: [B, H, K, V], or [1, H, K, V] of the document crossing it
    outs = []
    for a in range(0, T, tile):
        b = min(T, a + tile)
        xs = [x[:, a:b] for x in (q, k, v, g, beta)]
        if cu is None:
            cu_local = None
            S0 = carry if carry is not None else q.new_zeros(B, H, K, V, dtype=dt)
        else:
            cu_local, continues = tile_segments(cu, a, b)
            first = carry if continues and carry is not None else q.new_zeros(1, H, K, V, dtype=dt)
            S0 = torch.cat([first, q.new_zeros(len(cu_local) - 2, H, K, V, dtype=dt)]) if len(cu_local) > 2 else first
        o, carry = checkpoint(_tile, *xs, S0, cu_local, scale, chunk_size, use_reentrant=False)
        outs.append(o)
    return torch.cat(outs, dim=1)
