"""Routed experts of the latent MoE, stored stacked, run on tokens grouped by expert.

E_i(z) = W2_i[SiTU(W1_i z) * cap(W3_i z)] in the latent width l. Parameters are stacked so one module holds all
local experts: `w1 [E_local, Im, l]`, `w3 [E_local, Im, l]`, `w2 [E_local, l, Im]`.

HF mapping (model/hf.py): `experts.{j}.w1.weight` <-> `experts.w1[j - expert_offset]` (same for w3 and w2; the
HF per-expert weights have exactly these [out, in] shapes), for the global expert ids
j in [expert_offset, expert_offset + num_local).

The expert maths lives in two pure functions, `grouped_forward` and `grouped_backward` (hand-written gradient
that recomputes the activations from the inputs, or reads them when the forward kept them), shared by
`forward_grouped` here, the fused local dispatcher (model/moe/dispatch.py) and the all-to-all dispatcher, so
every path computes the same numbers for the same rows.

Speed on CPU (bench/moe.py): the nine expert GEMMs per expert are the floor; everything else is overhead. So the
rows are processed in blocks of ~BLOCK_ROWS (`expert_blocks`): rows gathered per block (never an [M, l] copy),
per-expert GEMMs into the block (one bmm when a block holds equal-sized consecutive experts, i.e. balanced
routing), the row-wise SiTU-GLU once per block, every temporary written into reused scratch blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from model.config import K3Config
from model.ffn import cap, situ
from model.norm import upcast

BLOCK_ROWS = 512  # rows per block of consecutive experts: elementwise work runs once per block, not per expert


class _Scratch:
    """Per-call scratch blocks [rows, cols] reused across blocks: every temporary of the expert loop is written
    into one of these (out= / in place), because on CPU a fresh 0.5 MB tensor per op costs more than the op
    (the allocator hands freed blocks back to the OS, and the kernel re-zeroes the pages on the next touch)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows, self.device = rows, device
        self.bufs: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, m: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.bufs.get(name)
        if buf is None or buf.shape[1] != cols or buf.dtype != dtype:
            buf = self.bufs[name] = torch.empty(self.rows, cols, dtype=dtype, device=self.device)
        return buf[:m]


def expert_blocks(counts: list[int], block_rows: int | None = None) -> list[tuple[int, int, list[tuple]]]:
    """Cut the grouped rows into blocks of about block_rows rows: whole consecutive small experts together, a big
    expert in pieces of <= block_rows rows. [(start, rows, [(expert, offset in block, m, first piece?), ...])],
    empty experts left out.

    The GLU is row-wise, so it runs once per block (few large ops instead of many tiny ones when experts are
    small; cache-sized ones when they are big), while the GEMMs still run per expert piece; weight gradients
    accumulate over an expert's pieces in row order (which depends on its row count only)."""
    block_rows = block_rows or BLOCK_ROWS
    blocks: list[tuple[int, int, list[tuple]]] = []
    cur: list[tuple] = []
    start, rows = 0, 0
    for e, m in enumerate(counts):
        for o in range(0, m, block_rows):
            piece = min(block_rows, m - o)
            if cur and rows + piece > block_rows:
                blocks.append((start, rows, cur))
                start, rows, cur = start + rows, 0, []
            cur.append((e, rows, piece, o == 0))
            rows += piece
    if cur:
        blocks.append((start, rows, cur))
    return blocks


def _uniform(experts: list[tuple]) -> tuple[int, int, int] | None:
    """(first expert, G, m) when a block is G whole consecutive experts with m rows each (balanced routing): its
    GEMMs then run as one bmm (the same per-matrix GEMMs, bitwise, without G Python round trips)."""
    e0, _, m, _ = experts[0]
    if len(experts) > 1 and all(e == e0 + i and mi == m and first for i, (e, _, mi, first) in enumerate(experts)):
        return e0, len(experts), m
    return None


def _rows_by_weight(
    experts, uni, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transpose_w: bool, accumulate: bool = False
) -> None:
    """out[rows of e] (+)= x[rows of e] @ op(w[e]) for each expert (piece) of a block; op = transpose or not."""
    if uni is not None:
        e0, G, m = uni
        wb = w[e0 : e0 + G].transpose(1, 2) if transpose_w else w[e0 : e0 + G]
        ob = out.view(G, m, out.shape[1])
        if accumulate:
            ob.baddbmm_(x.view(G, m, x.shape[1]), wb)
        else:
            torch.bmm(x.view(G, m, x.shape[1]), wb, out=ob)
        return
    for e, o, m, _ in experts:
        we = w[e].t() if transpose_w else w[e]
        if accumulate:
            out[o : o + m].addmm_(x[o : o + m], we)
        else:
            torch.mm(x[o : o + m], we, out=out[o : o + m])


def _rows_t_by_rows(experts, uni, x: torch.Tensor, y: torch.Tensor, out_E: torch.Tensor) -> None:
    """out_E[e] (+)= x[rows of e]^T @ y[rows of e] (a weight gradient; later pieces of an expert accumulate)."""
    if uni is not None:
        e0, G, m = uni
        torch.bmm(x.view(G, m, x.shape[1]).transpose(1, 2), y.view(G, m, y.shape[1]), out=out_E[e0 : e0 + G])
        return
    for e, o, m, first in experts:
        if first:
            torch.mm(x[o : o + m].t(), y[o : o + m], out=out_E[e])
        else:
            out_E[e].addmm_(x[o : o + m].t(), y[o : o + m])


def _tanh_into(h: torch.Tensor, beta: float, out: torch.Tensor) -> torch.Tensor:
    """tanh(h/beta) = 2*sigmoid(2h/beta) - 1, written into `out` in three passes (ATen's CPU sigmoid is ~4x
    faster than its tanh)."""
    u = torch.mul(h, 2.0 / beta, out=out).sigmoid_()
    return torch.add(torch.tensor(-1.0, dtype=u.dtype), u, alpha=2.0, out=u)


def _glu(h1: torch.Tensor, h3: torch.Tensor, beta1: float, beta2: float, ws: _Scratch, grad: bool = False):
    """a = SiTU(h1) * cap(h3) = b1*b2 * sg1*t1*t3 in >= fp32 ([R, Im] each; sg1 = sigmoid(h1), t1 = tanh(h1/b1),
    t3 = tanh(h3/b2)), and with grad=True also (da/dh1, da/dh3), with as few elementwise passes as we can:

        da/dh1 = b2*sg1*t3 * (1 - t1*(t1 + b1*sg1 - b1)),   da/dh3 = b1*t1*sg1 * (1 - t3^2)

    All results live in scratch blocks of `ws` (valid until the next call)."""
    h1, h3 = upcast(h1), upcast(h3)
    R, Im, cd = h1.shape[0], h1.shape[1], h1.dtype
    sg1 = torch.sigmoid(h1, out=ws("sg1", R, Im, cd))
    t1 = _tanh_into(h1, beta1, ws("t1", R, Im, cd))
    t3 = _tanh_into(h3, beta2, ws("t3", R, Im, cd))
    if not grad:
        return t1.mul_(sg1.mul_(t3)).mul_(beta1 * beta2)  # the same products, in the same order, as below
    one = torch.ones((), dtype=cd)
    c = torch.mul(sg1, t3, out=ws("c", R, Im, cd))  # sg1*t3
    a = torch.mul(t1, c, out=ws("a", R, Im, cd)).mul_(beta1 * beta2)
    d1 = torch.add(t1, sg1, alpha=beta1, out=ws("d1", R, Im, cd)).sub_(beta1)
    d1 = torch.addcmul(one, t1, d1, value=-1.0, out=d1).mul_(c).mul_(beta2)
    d3 = torch.addcmul(one, t3, t3, value=-1.0, out=t3).mul_(t1).mul_(sg1).mul_(beta1)  # t3 no longer needed
    return a, d1, d3


def _rows(src: torch.Tensor, rows_M: torch.Tensor | None, sl: slice, out: torch.Tensor) -> torch.Tensor:
    """The grouped rows `sl`: a slice of src, or (rows_M given) src's rows rows_M[sl] gathered into `out` now, so
    the whole [M, l] gathered copy never exists and each block is cache-hot for its GEMMs."""
    return src[sl] if rows_M is None else torch.index_select(src, 0, rows_M[sl], out=out)


def grouped_forward(
    z_ML: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    beta1: float,
    beta2: float,
    keep_h: list[torch.Tensor] | None = None,
    rows_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_ML for rows grouped contiguously by expert (counts[e] rows for local expert e): three GEMMs per expert.

    `rows_M` (optional): grouped row i is z_ML[rows_M[i]] (z_ML is then the ungrouped source, e.g. z_NL).
    `keep_h` (a list, optional) receives the GLU inputs [W1 z, W3 z] of each block ([2, rows, Im] each) for a
    backward that keeps them: block-sized tensors, which the CPU allocator recycles from step to step, where one
    [2, M, Im] tensor would be fresh pages (re-zeroed by the kernel, ~0.4 ms/MB here) every step.
    Gate and up are two GEMMs into contiguous blocks: on CPU one [2Im, l] GEMM is no faster, and needs a copy
    of the stacked weights.
    """
    M, l, Im, dt = sum(counts), z_ML.shape[1], w1.shape[1], z_ML.dtype
    y_ML = torch.empty(M, w2.shape[1], dtype=dt, device=z_ML.device)
    blocks = expert_blocks(counts)
    ws = _Scratch(max((r for _, r, _ in blocks), default=0), z_ML.device)
    for start, R, experts in blocks:
        sl = slice(start, start + R)
        z = _rows(z_ML, rows_M, sl, ws("z", R, l, dt))  # [R, l]
        if keep_h is None:
            h1, h3 = ws("h1", R, Im, dt), ws("h3", R, Im, dt)  # [R, Im]
        else:
            keep_h.append(torch.empty(2, R, Im, dtype=dt, device=z_ML.device))
            h1, h3 = keep_h[-1]
        uni = _uniform(experts)
        _rows_by_weight(experts, uni, z, w1, h1, transpose_w=True)
        _rows_by_weight(experts, uni, z, w3, h3, transpose_w=True)
        a = _glu(h1, h3, beta1, beta2, ws).to(dt)  # [R, Im]
        _rows_by_weight(experts, uni, a, w2, y_ML[sl], transpose_w=True)
    return y_ML


def grouped_backward(
    z_ML: torch.Tensor,
    g_ML: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    beta1: float,
    beta2: float,
    row_weight_M: torch.Tensor | None = None,
    keep_h: list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None,
    rows_M: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of sum_m <g_m, p_m * y_m> for y = grouped_forward(z): (g_z, g_w1, g_w3, g_w2, g_p), g_z grouped.

    `row_weight_M` (p, >= fp32) is the per-row mixing weight, or None for p = 1 (then g_p is None). `rows_M`: as
    in grouped_forward, for both z_ML and g_ML. The GLU inputs are recomputed from z (eight GEMMs per expert)
    unless the forward kept them (`keep_h`, six GEMMs); <g, y> for g_p is taken as <g W2, a>, which avoids
    recomputing y.
    """
    M, l, Im, dt = sum(counts), z_ML.shape[1], w1.shape[1], z_ML.dtype
    g_z = torch.empty(M, l, dtype=dt, device=z_ML.device)
    g_w1, g_w3, g_w2 = torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)
    for e, m in enumerate(counts):
        if m == 0:  # an expert without tokens gets a zero gradient
            g_w1[e].zero_(), g_w3[e].zero_(), g_w2[e].zero_()
    g_p = None if row_weight_M is None else torch.empty_like(row_weight_M)
    blocks = expert_blocks(counts)
    ws = _Scratch(max((r for _, r, _ in blocks), default=0), z_ML.device)
    for b, (start, R, experts) in enumerate(blocks):
        sl = slice(start, start + R)
        z, g = _rows(z_ML, rows_M, sl, ws("z", R, l, dt)), _rows(g_ML, rows_M, sl, ws("g", R, l, dt))  # [R, l]
        uni = _uniform(experts)
        if keep_h is None:  # recompute the GLU inputs
            h1, h3 = ws("h1", R, Im, dt), ws("h3", R, Im, dt)  # [R, Im]
            _rows_by_weight(experts, uni, z, w1, h1, transpose_w=True)
            _rows_by_weight(experts, uni, z, w3, h3, transpose_w=True)
        else:
            h1, h3 = keep_h[b]  # kept by the forward, block b
        a, d1, d3 = _glu(h1, h3, beta1, beta2, ws, grad=True)  # >= fp32
        ga = ws("ga", R, Im, dt)  # [R, Im] = g W2
        _rows_by_weight(experts, uni, g, w2, ga, transpose_w=False)
        ga = upcast(ga)
        if row_weight_M is not None and g_p is not None:
            p = row_weight_M[sl].unsqueeze(-1)  # [R, 1]
            g_p[sl] = torch.mul(ga, a, out=ws("gaa", R, Im, ga.dtype)).sum(-1)  # <g W2, a> = <g, y>
            ga.mul_(p)
            g = torch.mul(g, p, out=ws("gp", R, l, dt))
        a = a.to(dt)
        g_h1, g_h3 = d1.mul_(ga).to(dt), d3.mul_(ga).to(dt)  # [R, Im]
        _rows_t_by_rows(experts, uni, g, a, g_w2)  # [l, Im] per expert
        _rows_t_by_rows(experts, uni, g_h1, z, g_w1)  # [Im, l]
        _rows_t_by_rows(experts, uni, g_h3, z, g_w3)
        _rows_by_weight(experts, uni, g_h1, w1, g_z[sl], transpose_w=False)  # [R, l]
        _rows_by_weight(experts, uni, g_h3, w3, g_z[sl], transpose_w=False, accumulate=True)
    return g_z, g_w1, g_w3, g_w2, g_p


class _GroupedExperts(torch.autograd.Function):
    """Autograd wrapper of grouped_forward/grouped_backward that saves only z_ML (activations recomputed)."""

    @staticmethod
    def forward(ctx, z_ML, w1, w3, w2, counts: list[int], beta1: float, beta2: float):  # type: ignore[override]
        ctx.save_for_backward(z_ML, w1, w3, w2)
        ctx.counts, ctx.betas = counts, (beta1, beta2)
        return grouped_forward(z_ML, counts, w1, w3, w2, beta1, beta2)

    @staticmethod
    def backward(ctx, g_ML):  # type: ignore[override]
        z_ML, w1, w3, w2 = ctx.saved_tensors
        g_z, g_w1, g_w3, g_w2, _ = grouped_backward(z_ML, g_ML.contiguous(), ctx.counts, w1, w3, w2, *ctx.betas)
        return g_z, g_w1, g_w3, g_w2, None, None, None


def _storage_key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride()


class LatentExperts(nn.Module):
    """The routed experts held by this rank: global ids [expert_offset, expert_offset + num_local)."""

    def __init__(self, config: K3Config, num_local: int | None = None, expert_offset: int = 0) -> None:
        super().__init__()
        E = config.num_experts
        self.num_experts = E
        self.num_local = E if num_local is None else int(num_local)
        self.expert_offset = int(expert_offset)
        if not (self.expert_offset >= 0 and self.expert_offset + self.num_local <= E):
            raise ValueError(
                f"local experts [{expert_offset}, {expert_offset}+{self.num_local}) exceed "
                f"num_experts={E}; fix num_local/expert_offset"
            )
        Im, l = config.moe_intermediate_size, config.routed_expert_hidden_size
        self.beta1 = float(config.activation_situ_beta)
        self.beta2 = float(config.activation_situ_linear_beta)
        self.init_std = config.initializer_range
        self.w1 = nn.Parameter(torch.empty(self.num_local, Im, l))
        self.w3 = nn.Parameter(torch.empty(self.num_local, Im, l))
        self.w2 = nn.Parameter(torch.empty(self.num_local, l, Im))
        self.lora: nn.Module | None = None  # stacked LoRA factors (model/lora.py ExpertLoRA), when adapted
        self._merged: dict | None = None  # merged weights made inside recompute_merged()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, init_std), expert j (global id) drawn from its own generator seeded by one draw of the global RNG
        plus j: the same weights whichever experts this rank holds (expert parallelism, sharded construction)."""
        if self.w1.is_meta:
            return
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        gen = torch.Generator(device=self.w1.device)
        for j in range(self.num_local):
            gen.manual_seed(base + self.expert_offset + j)
            for w in (self.w1, self.w3, self.w2):
                w[j].normal_(mean=0.0, std=self.init_std, generator=gen)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) as applied: the parameters, or with LoRA base + s * B @ A per expert (three bmm's)."""
        if self.lora is None:
            return self.w1, self.w3, self.w2
        lora: Any = self.lora  # model/lora.py ExpertLoRA (not imported here: model.lora builds on this module)
        merged = lora.merge(self.w1, self.w3, self.w2)
        self._remember(merged)
        return merged

    def _remember(self, merged: tuple[torch.Tensor, ...]) -> None:
        """Inside recompute_merged(): remember the made weights, by storage, for the pack hook."""
        if self._merged is not None:
            for w, t in zip(("w1", "w3", "w2"), merged):
                self._merged[_storage_key(t)] = (w, False)
                self._merged[_storage_key(t.transpose(1, 2))] = (w, True)  # grouped_mm saves the transposed view

    def _remake(self, w: str) -> torch.Tensor:
        """Weight `w` as weights() makes it (backward's re-make; MXFP4Experts dequantises too)."""
        return getattr(self, w) + self.lora.delta(w)  # type: ignore[union-attr, operator]

    def _recomputes(self) -> bool:
        return self.lora is not None

    @contextlib.contextmanager
    def recompute_merged(self) -> Iterator[None]:
        """With LoRA, the merged expert weights (as large as the local experts) are not kept for backward: the
        expert node saves a recipe and backward re-merges base + s * B @ A (bitwise the same: the same bmm on the
        same values), like the activations it recomputes; MXFP4 experts (model/moe/mxfp4_experts.py) re-dequantise
        too, with or without LoRA. Without either the saved weights are the parameters themselves (no copy), so
        nothing is done."""
        if not self._recomputes() or not torch.is_grad_enabled():
            yield
            return
        self._merged = {}

        def pack(t: torch.Tensor):
            w = self._merged.get(_storage_key(t)) if self._merged is not None else None
            return ("lora-merged", *w) if w is not None else t

        def unpack(saved):
            if isinstance(saved, tuple):
                with torch.no_grad():
                    w = self._remake(saved[1])
                return w.transpose(1, 2) if saved[2] else w
            return saved

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            self._merged = None

    def forward_grouped(self, z_ML: torch.Tensor, counts_E: torch.Tensor | list[int]) -> torch.Tensor:
        """Run local expert e on the counts_E[e] consecutive rows of z_ML: [M, l] -> [M, l] (M = sum counts)."""
        counts = counts_E.tolist() if isinstance(counts_E, torch.Tensor) else list(counts_E)
        if len(counts) != self.num_local or sum(counts) != z_ML.shape[0]:
            raise ValueError(
                f"counts_E must have {self.num_local} entries summing to {z_ML.shape[0]} rows; "
                f"got {len(counts)} summing to {sum(counts)}"
            )
        return _GroupedExperts.apply(z_ML.contiguous(), *self.weights(), counts, self.beta1, self.beta2)

    def expert(self, j: int, z_NL: torch.Tensor) -> torch.Tensor:
        """Reference: local expert j on arbitrary rows with plain autograd (tests, debugging)."""
        w1, w3, w2 = self.weights()
        a = (situ(z_NL @ w1[j].t(), self.beta1) * cap(z_NL @ w3[j].t(), self.beta2)).to(z_NL.dtype)
        return a @ w2[j].t()

    def extra_repr(self) -> str:
        return (
            f"num_local={self.num_local}, expert_offset={self.expert_offset}, "
            f"w1={tuple(self.w1.shape)}, w2={tuple(self.w2.shape)}"
        )
