"""Sequence-tiled chunked KDA for training (`train.mixer_tile_tokens`, K3ForCausalLM.set_mixer_tiling).

The chunked kernel is a scan over chunks carrying the recurrent state S [B, H, K, V]. `tiled_chunk_kda` runs the
same scan over tiles of `tile` tokens in one autograd node (`TiledKDA`): forward calls `chunk_kda` tile by tile
without a graph, each from the previous tile's final state, and keeps only the inputs (q, k, v, g, beta, which the
layer holds anyway) and the state entering each tile; backward recomputes one tile at a time, last first, and
carries the gradient of the state backwards, so the chunk kernel's ~30 per-chunk tensors exist for one tile
instead of the whole sequence. Packed documents (`cu_seqlens`, B = 1) are cut at the tile edges: the document
crossing an edge continues from the carried state, every document starting inside a tile starts from zero. Every
chunk is computed by the same maths as untiled (chunks align with the tiles when `tile` is a multiple of the chunk
size and documents start on chunk boundaries; otherwise only the chunk grid moves): the values agree to rounding.
"""

from __future__ import annotations

import torch

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


def _initial_state(carry, cu_local, continues: bool) -> torch.Tensor:
    """The tile's initial states: the carry for the batch rows (no cu_seqlens) or the continuing document, zeros for
    documents starting inside the tile."""
    if cu_local is None:
        return carry
    first = carry if continues else torch.zeros_like(carry)
    rest = carry.new_zeros(len(cu_local) - 2, *carry.shape[1:])
    return torch.cat([first, rest]) if len(cu_local) > 2 else first


class TiledKDA(torch.autograd.Function):
    """(q, k, v, g, beta, tile, cu, scale, chunk_size) -> o. Forward runs the tiles without a graph and keeps the
    inputs and the state entering every tile; backward recomputes one tile at a time, last first, with the
    gradient of its final state carried backwards, and writes each tile's input gradients into one full-size
    buffer per input (slicing in autograd would add a full-size zero tensor per tile and input instead)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, tile: int, cu, scale, chunk_size: int):
        B, T, H, K = q.shape
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        carry = q.new_zeros(B if cu is None else 1, H, K, v.shape[-1], dtype=dt)
        o, ctx.tiles, states = [], [], []
        for a in range(0, T, tile):
            b = min(T, a + tile)
            cu_local, continues = (None, True) if cu is None else tile_segments(cu, a, b)
            states.append(carry)
            o_t, carry = _tile(
                *(x[:, a:b] for x in (q, k, v, g, beta)),
                _initial_state(carry, cu_local, continues),
                cu_local,
                scale,
                chunk_size,
            )
            o.append(o_t)
            ctx.tiles.append((a, b, cu_local, continues))
        ctx.scale, ctx.chunk_size = scale, chunk_size
        ctx.save_for_backward(q, k, v, g, beta, *states)
        return torch.cat(o, dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, g, beta, *states = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        dcarry = None  # gradient of the state leaving the tile being recomputed
        for (a, b, cu_local, continues), S_in in zip(reversed(ctx.tiles), reversed(states)):
            with torch.enable_grad():
                xs = [x[:, a:b].detach().requires_grad_() for x in (q, k, v, g, beta)]
                S_leaf = S_in.detach().requires_grad_()
                o_t, S_out = _tile(
                    *xs, _initial_state(S_leaf, cu_local, continues), cu_local, ctx.scale, ctx.chunk_size
                )
                outs, douts = [o_t], [do[:, a:b]]
                if dcarry is not None:
                    outs.append(S_out)
                    douts.append(dcarry)
                got = torch.autograd.grad(outs, [*xs, S_leaf], douts, allow_unused=True)
            for full, gr in zip(grads, got[:5]):
                full[:, a:b] = 0 if gr is None else gr
            dcarry = got[5]
        return (*grads, None, None, None, None)


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
    cu = None if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    return TiledKDA.apply(q, k, v, g, beta, tile, cu, scale, chunk_size)
