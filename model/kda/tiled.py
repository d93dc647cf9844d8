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
import torch.nn.functional as F

from model.kda.conv import causal_depthwise_conv, l2_normalize
from model.kda.ops import chunk_kda


def tile_segments(cu: list[int], a: int, b: int) -> tuple[list[int], bool]:
    """Cumulative lengths (from 0) of the document pieces inside tokens [a, b), and whether the first piece
    continues a document that started before a."""
    inner = [c - a for c in cu if a < c < b]
    return [0, *inner, b - a], a not in cu


def _tile(us, ws, g, beta, S0, a: int, seg_T, cu_local, scale, chunk_size, shape, lower_bound=None):
    """One tile's short conv + SiLU + L2 norms + chunked core. us: the tile's pre-conv q, k, v inputs [B, n, P] led
    by up to W-1 inputs before the tile (its conv prefix); ws: the conv weights [P, W]."""
    h, K = shape
    n = g.shape[1]
    W = ws[0].shape[-1]
    seg = None if seg_T is None else seg_T[a : a + n] - a  # document starts relative to the tile (< 0: before it)
    xs = []
    for u, w in zip(us, ws):
        p0 = u.shape[1] - n
        prefix = F.pad(u[:, :p0], (0, 0, W - 1 - p0, 0))
        xs.append(F.silu(causal_depthwise_conv(u[:, p0:], w, prefix, seg)).view(u.shape[0], n, h, K))
    cu = None if cu_local is None else torch.tensor(cu_local, device=g.device)  # host -> device, no sync
    o, S = chunk_kda(
        l2_normalize(xs[0]),
        l2_normalize(xs[1]),
        xs[2],
        g,
        beta,
        scale=scale,
        initial_state=S0,
        output_final_state=True,
        cu_seqlens=cu,
        chunk_size=chunk_size,
        lower_bound=lower_bound,
        cu_seqlens_cpu=cu_local,
    )
    assert S is not None  # output_final_state=True
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
    """(spec, uq, uk, uv, wq, wk, wv, g, beta) -> o [B, T, h, K]: the short conv and the recurrence over tiles.
    Forward runs the tiles without a graph and keeps the inputs and the state entering every tile; backward
    recomputes one tile at a time, last first, with the gradient of its final state carried backwards, and adds
    each tile's input gradients into one full-size buffer per input (a tile's conv prefix belongs to the tile
    before it)."""

    @staticmethod
    def forward(ctx, spec, uq, uk, uv, wq, wk, wv, g, beta):
        tile, cu, seg_T, scale, chunk_size, (h, K), lb = spec
        B, T = g.shape[:2]
        W = wq.shape[-1]
        dt = torch.float64 if uq.dtype == torch.float64 else torch.float32
        carry = g.new_zeros(B if cu is None else 1, h, K, K, dtype=dt)
        o, ctx.tiles, states = [], [], []
        for a in range(0, T, tile):
            b = min(T, a + tile)
            cu_local, continues = (None, True) if cu is None else tile_segments(cu, a, b)
            states.append(carry)
            a0 = max(0, a - (W - 1))
            S0 = _initial_state(carry, cu_local, continues)
            us = [u[:, a0:b] for u in (uq, uk, uv)]
            o_t, carry = _tile(
                us, (wq, wk, wv), g[:, a:b], beta[:, a:b], S0, a, seg_T, cu_local, scale, chunk_size, (h, K), lb
            )
            o.append(o_t)
            ctx.tiles.append((a, a0, b, cu_local, continues))
        ctx.spec = spec
        ctx.save_for_backward(uq, uk, uv, wq, wk, wv, g, beta, *states)
        return torch.cat(o, dim=1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        uq, uk, uv, wq, wk, wv, g, beta, *states = ctx.saved_tensors
        _, _, seg_T, scale, chunk_size, shape, lb = ctx.spec
        du = [torch.zeros_like(u) for u in (uq, uk, uv)]
        dw = [torch.zeros_like(w) for w in (wq, wk, wv)]
        dg, dbeta = torch.empty_like(g), torch.empty_like(beta)
        dcarry = None  # gradient of the state leaving the tile being recomputed
        for (a, a0, b, cu_local, continues), S_in in zip(reversed(ctx.tiles), reversed(states)):
            with torch.enable_grad():
                us = [u[:, a0:b].detach().requires_grad_() for u in (uq, uk, uv)]
                ws = [w.detach().requires_grad_() for w in (wq, wk, wv)]
                g_t, b_t = g[:, a:b].detach().requires_grad_(), beta[:, a:b].detach().requires_grad_()
                S_leaf = S_in.detach().requires_grad_()
                S0 = _initial_state(S_leaf, cu_local, continues)
                o_t, S_out = _tile(us, ws, g_t, b_t, S0, a, seg_T, cu_local, scale, chunk_size, shape, lb)
                outs, douts = [o_t], [do[:, a:b]]
                if dcarry is not None:
                    outs.append(S_out)
                    douts.append(dcarry)
                got = torch.autograd.grad(outs, [*us, *ws, g_t, b_t, S_leaf], douts, allow_unused=True)
            zero = lambda x, gr: torch.zeros_like(x) if gr is None else gr  # noqa: E731
            for full, u, gr in zip(du, us, got[:3]):
                full[:, a0:b].add_(zero(u, gr))
            for full, w, gr in zip(dw, ws, got[3:6]):
                full.add_(zero(w, gr))
            dg[:, a:b], dbeta[:, a:b] = zero(g_t, got[6]), zero(b_t, got[7])
            dcarry = got[8]
        return (None, *du, *dw, dg, dbeta)


def tiled_kda_mixer(
    us: list[torch.Tensor],
    ws: list[torch.Tensor],
    g: torch.Tensor,
    beta: torch.Tensor,
    tile: int,
    shape: tuple[int, int],
    cu_seqlens: torch.Tensor | None = None,
    seg_T: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    lower_bound: float | None = None,
    cu_seqlens_host: list[int] | None = None,
) -> torch.Tensor:
    """The KDA mixer core from the pre-conv q, k, v inputs `us` [B, T, h*K] and conv weights `ws` [h*K, W]: short
    conv + SiLU, L2 norms and `chunk_kda` (zero initial state), over tiles of `tile` tokens each recomputed on its
    own in backward (module docstring). `shape` = (h, K); `seg_T`: document starts (model/kda/layer.py)."""
    if tile <= 0:
        raise ValueError(f"mixer tiling needs tile > 0 tokens, got {tile}")
    cu = None if cu_seqlens is None else cu_seqlens_host or [int(c) for c in cu_seqlens.tolist()]
    return TiledKDA.apply((tile, cu, seg_T, scale, chunk_size, shape, lower_bound), *us, *ws, g, beta)
