"""The chunked KDA core as one autograd node: WY/UT forward (docs/model.md §3) and its hand-written backward.

Per chunk (chunk-major groups [n, X = B*H, C, D], copied from [B, T, H, D] group by group), with q scaled by the
query scale, G = cumsum(g) and Gam = exp(G):

    A_qk[r, i] = sum_c q_r exp(G_r - G_i) k_i  (i <= r)        A_kk: same with k_r, i < r
    T = (I + Diag(beta) A_kk)^-1      W = T Diag(beta) (k Gam)      U = T Diag(beta) v
    Vp_n = U_n - W_n S_n              S_{n+1} = Diag(exp(G_last)) S_n + Kd^T Vp_n,   Kd = k exp(G_last - G)
    o_n = (q Gam) S_n + A_qk Vp_n

Why one node: autograd through ~60 small batched ops costs more than the maths on CPU (transposed operands of
elementwise backward ops, cat/copy of gradients, one node per op). The backward here is batched matmuls plus a
few in-place elementwise passes; only the state recurrence runs per chunk (two matmuls each way). Chunks stream
in groups of ~`GROUP_BYTES` per tensor: at T = 2048 whole-sequence tensors (2 MB each, ~30 of them) make every op
run from DRAM at a third of its in-cache speed. The gradient of the cumulative decay G is gathered per position
(q dq - k dk style terms, see `_DecayFactors`) and turned into dg by one reverse cumulative sum per chunk; the state
path contributes sum_V dS_{n+1} * S_{n+1} to every position.

Layout: each group's inputs are copied into contiguous chunk-major buffers, fused with their first op (q * scale,
cumsum(g), v straight into the right half of [kg | v]); a strided view would make every elementwise op slow and
every matmul copy its operand first. Per-chunk loop views come from one `unbind` each; strip products accumulate
in place through `[batch, R, D]` views (`as_batched`) instead of `+=` on slices (which copies back). The UT backward
uses
T^T dW = -(T^T dU) S^T: one [C, V] triangular product and one state matmul instead of a state matmul and a
[C, K + V] triangular product.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from model.kda.block_lower import BlockLower

# largest exponent one score factor may carry (fp32 max ~ e^88.7)
EXP_LIMIT = {torch.float32: 80.0, torch.float64: 600.0}
# decay factors below exp(floor) are flushed to exactly 0 (fp32: 1e-30, fp64: 1e-300). A factor near finfo.tiny
# (1.2e-38) makes every product with it a subnormal, and x86 cores take a microcode assist per subnormal operand
# or result (an Intel Xeon ran chunk 64 at T = 2048 7x slower on them; docs/performance.md, "Denormals"). 0 is a
# normal operand, and a factor >= 1e-30 times an operand >= 1e-8 stays normal; the maths changes by < 1e-30 per
# factor.
EXP_FLOOR = {torch.float32: math.log(1e-30), torch.float64: math.log(1e-300)}
# The UT transform runs scaled by a power of two (exact): W = T Diag(beta) kg is computed from kg times UT_SCALE and
# the strips of T from Diag(beta) A_kk times UT_SCALE; both come back unscaled with entries below the floor (1e-30)
# flushed to 0 (`_unscale_flushed`, `BlockLower.unit_inverse`). Unscaled, W_r ~ exp(G_r) and the strips of
# T ~ exp(G_r - G_i) fall below 1e-38 within a 64-chunk under K3's gate (G_63 ~ -160): products of two values
# >= 1e-30 can be anything down to 1e-60, and those matmuls wrote fp32 subnormals. Flush-to-zero cannot help
# there: it is per-thread state (MXCSR), and torch's intra-op workers keep their own (2 threads left 38,734
# subnormal values at T = 2048). Scaled, a floored value (>= 1e-30) is >= 1.27 times its operand. fp32 headroom:
# UT_SCALE |W| and UT_SCALE |T| (strips) below 3.4e38, i.e. |W|, |T| below 2.7e8 (both ~1 or less).
UT_SCALE = {torch.float32: 2.0**100, torch.float64: 2.0**900}


def sub_block_size(C: int, max_abs_g: float, dtype: torch.dtype) -> int:
    """Largest divisor S of C whose half-block stays in range, (S // 2) * max|g| <= limit, or 0 (exact form)."""
    limit = EXP_LIMIT[dtype]
    for S in range(C, 1, -1):
        if C % S == 0 and (S // 2) * max_abs_g <= limit:
            return S
    return 0


def _unscale_flushed(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in place on x, entries with |x / scale| <= floor (1e-30) set to 0: two passes, never a
    subnormal (x holds values times `scale`, a power of two)."""
    torch.ops.aten.hardshrink.out(x, scale * math.exp(EXP_FLOOR[x.dtype]), out=x)
    return x.mul_(1.0 / scale)


def _exp_floored(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= 0 terms whose underflow is harmless, with exp(x) <= exp(EXP_FLOOR) (1e-30 in fp32) flushed
    to exactly 0: never a subnormal factor. In place on x (callers pass a fresh temporary).

    Clamped to the floor before exp and thresholded after, not sent to exp as -inf: the vectorised exp takes a slow
    path for -inf (3.3x) and for arguments whose result is subnormal (35x; FTZ does not help), while clamp and
    threshold are plain passes (1.4 ms against 4.9 ms for -inf + exp on 1M values, AMD EPYC, bit-identical)."""
    floor = EXP_FLOOR[x.dtype]
    return torch.nn.functional.threshold(x.clamp_(min=floor).exp_(), _EXP_AT_FLOOR[x.dtype], 0.0, inplace=True)


# exp(EXP_FLOOR) in each dtype, as exp computes it there: the clamped entries equal it exactly and go to 0
_EXP_AT_FLOOR = {dt: float(torch.tensor(f, dtype=dt).exp()) for dt, f in EXP_FLOOR.items()}


def _exp_half_floor(x: torch.Tensor) -> torch.Tensor:
    """exp(max(x, EXP_FLOOR / 2)) in place: a strip factor, >= 1e-15 (fp32), so the product of two is >= 1e-30
    and never subnormal. Clamped, not flushed: a factor below 1e-15 reads as 1e-15, an error below 1e-15 |a b| in
    a term a b exp(G_r - G_i), the bound flushing it to 0 would give too (`_DecayFactors`), one pass less."""
    return x.clamp_(min=0.5 * EXP_FLOOR[x.dtype]).exp_()


_TINY_DOUBLE = [1e-300]  # in a list: Python must not fold the probe's product at compile time


def flush_denormals_enabled() -> bool:
    """Whether this thread flushes subnormals to zero (x86 MXCSR FTZ/DAZ, set by torch.set_flush_denormal): a
    Python float product, which runs on the same SSE unit, underflows to exactly 0 then. No tensor op, so
    dispatch modes (bench/probes.py) never see it."""
    return _TINY_DOUBLE[0] * 1e-10 == 0.0


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Flush-to-zero on the calling thread for the kernel's duration, the caller's setting restored after.

    Not what keeps the kernel normal: decay factors are floored (`_exp_floored`) and the UT transform runs scaled
    (`UT_SCALE`), so on the bench's inputs no op writes a subnormal, with or without FTZ, on any number of threads
    (but for an isolated product of a tiny gradient and a tiny factor). Kept for what construction misses: when every
    channel decays near the gate bound at once (g < -4 everywhere), the diagonal sub-blocks' factors span e^+-80
    and their score products underflow. FTZ turns those into zeros on the calling thread only:
    torch.set_flush_denormal is per-thread state, intra-op worker threads keep theirs (docs/performance.md,
    "Denormals"). The autograd Function scopes it in forward and in backward, whichever thread runs them."""
    if flush_denormals_enabled():
        yield
        return
    if not torch.set_flush_denormal(True):  # not x86 with SSE3: nothing to restore
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


# --------------------------------------------------------------------------------------------------------------
# decay factors: exp(G_r - G_i) = P_r * Q_i, split so that no factor overflows
# --------------------------------------------------------------------------------------------------------------
class _DecayFactors:
    """exp(G_r - G_i) on the causal part (i <= r) of a chunk, as products of a row and a column factor.

    Rows are split in n_s sub-blocks of S rows. Diagonal blocks split the exponent at the block's middle row m:
    P = exp(G_r - G_m), Q = exp(G_m - G_i) = 1 / P, both within exp(+-(S // 2) max|g|) <= exp(limit) (entries
    above the diagonal may overflow in the score matmul; `tril` drops them). The strip below diagonal block b
    (all later rows, columns of b) splits at b's last row e: exp(G_r - G_e) and exp(G_e - G_i) are both <= 1
    (g <= 0), and each is clamped at 1e-15 (`_exp_half_floor`), so every product is >= 1e-30. The exact bound
    on what that changes: a product changes only if one factor is < 1e-15, and the other is <= 1, so only decays
    exp(G_r - G_i) < 1e-15 change, and a changed term a_rc b_ic exp(G_rc - G_ic) of a score moves by
    < 1e-15 |a_rc b_ic|: relative to the operands, not the 1e-30 absolute of flush-to-zero. For K3 (q, k
    L2-normalised, q scaled by K^-1/2) a score moves by < 1.25e-16, an output row by < 1.25e-16 sum_i |Vp_i|
    over the strip's columns: ~1e-9 of an fp32 ulp of an O(1) value. Backward terms alike: < 1e-15 |dA_ri| |b_i|.
    Floors of 1e-30 per factor would make the bound 1e-30 |a b|, but their products (down to 1e-60) would need
    the strip products scaled like the UT transform (`UT_SCALE`), forward and backward, and explicitly unscaled
    before every GEMM that consumes them. S == 0
    (growth, or decay too strong even for S = 2): one block with the exact [C, C, K] factor D = exp(G_r - G_i),
    zero above the diagonal.

    Three products serve the forward scores and all four backward terms: with M a causal weight matrix,
        scores:   A[r, i]  = sum_c (a P)_r (b Q)_i
        rows:     Y_r      = sum_i M[r, i] exp(G_r - G_i) Z_i  = P_r (M (Q Z))_r
        columns:  Y_i      = sum_r M[r, i] exp(G_r - G_i) Z_r  = Q_i (M^T (P Z))_i
    and dG_r += a_r * (grad of a_r), dG_i -= b_i * (grad of b_i) turns them into gradients of G.
    """

    def __init__(self, G: torch.Tensor, S: int):
        *lead, C, K = G.shape
        self.exact = S == 0
        self.G = G  # cumulative decay: last_row_decay, and Gam (recomputed in backward) come from it
        self.S = C if self.exact else S
        self.n_s = C // self.S
        if self.exact:
            causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
            diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [..., r, i, K] = G_r - G_i
            self.D = _exp_floored(torch.where(causal[:, :, None], diff, torch.full_like(diff, -torch.inf)))
            return
        G_blk = G.view(*lead, self.n_s, S, K)
        self.P = (G_blk - G_blk[..., S // 2 : S // 2 + 1, :]).exp_().view_as(G)  # [..., C, K]
        self.Q = torch.reciprocal(self.P)
        self.strips = []  # (P_s [..., C - r0, K], Q_s [..., S, K]) below diagonal block b, r0 = (b + 1) S
        for b in range(self.n_s - 1):
            r0 = (b + 1) * S
            G_e = G[..., r0 - 1 : r0, :]
            P_s = _exp_half_floor(G[..., r0:, :] - G_e)
            self.strips.append([P_s, _exp_half_floor(G_e - G[..., r0 - S : r0, :])])

    def _blk(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-2], self.n_s, self.S, x.shape[-1])

    # ---- products of the inputs with the factors (saved by the forward for the backward)
    def rows(self, a: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.exact:
            return a, []
        return a * self.P, [a[..., (b + 1) * self.S :, :] * P_s for b, (P_s, _) in enumerate(self.strips)]

    def cols(self, b: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.exact:
            return b, []
        S = self.S
        return b * self.Q, [b[..., j * S : (j + 1) * S, :] * Q_s for j, (_, Q_s) in enumerate(self.strips)]

    # ---- the three operations
    def scores(self, aP, aP_s, bQ, bQ_s, diagonal: int) -> BlockLower:
        """A (lower triangle from `diagonal`) from the row products of a and the column products of b."""
        if self.exact:
            A = (aP.unsqueeze(-2) * self.D * bQ.unsqueeze(-3)).sum(-1).tril_(diagonal)
            return BlockLower(A.unsqueeze(-3), [])
        diag = torch.matmul(self._blk(aP), self._blk(bQ).transpose(-1, -2)).tril_(diagonal)
        return BlockLower(diag, [a_s @ b_s.transpose(-1, -2) for a_s, b_s in zip(aP_s, bQ_s)])

    def row_apply(self, M: BlockLower, bQ, bQ_s, out: torch.Tensor | None = None) -> torch.Tensor:
        """Y_r = sum_i M[r, i] exp(G_r - G_i) b_i (written into `out` when given)."""
        if self.exact:
            return torch.sum(M.diag.squeeze(-3).unsqueeze(-1) * self.D * bQ.unsqueeze(-3), -2, out=out)
        Y = torch.matmul(M.diag, self._blk(bQ), out=None if out is None else self._blk(out))
        Y = Y.view_as(bQ).mul_(self.P)
        for b, ((P_s, _), St, b_s) in enumerate(zip(self.strips, M.strips, bQ_s)):
            Y[..., (b + 1) * self.S :, :].addcmul_(P_s, St @ b_s)
        return Y

    def col_apply(self, Ms: list[BlockLower], aPs: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> torch.Tensor:
        """Y_i = sum_j sum_r M_j[r, i] exp(G_r - G_i) a_j,r (summed over the pairs j)."""
        if self.exact:
            Y = None
            for M, (aP, _) in zip(Ms, aPs):
                term = (M.diag.squeeze(-3).unsqueeze(-1) * self.D * aP.unsqueeze(-2)).sum(-3)
                Y = term if Y is None else Y + term
            assert Y is not None  # at least one pair
            return Y
        Y = torch.matmul(Ms[0].diag.transpose(-1, -2), self._blk(aPs[0][0]))
        for M, (aP, _) in zip(Ms[1:], aPs[1:]):
            Y.flatten(0, -3).baddbmm_(M.diag.transpose(-1, -2).flatten(0, -3), self._blk(aP).flatten(0, -3))
        Y = Y.view_as(aPs[0][0]).mul_(self.Q)
        S = self.S
        for j, (_, Q_s) in enumerate(self.strips):
            acc = Ms[0].strips[j].transpose(-1, -2) @ aPs[0][1][j]
            for M, (_, a_s) in zip(Ms[1:], aPs[1:]):
                acc.flatten(0, -3).baddbmm_(M.strips[j].transpose(-1, -2).flatten(0, -3), a_s[j].flatten(0, -3))
            Y[..., j * S : (j + 1) * S, :].addcmul_(Q_s, acc)
        return Y

    def last_row_decay(self) -> torch.Tensor:
        """E = exp(G_last - G) [..., C, K] (<= 1). Rows of the last block: one floored exp (< 1e-30 -> 0; within a
        block the decay spans up to (S - 1) max|g|, so products of the block's own factors would be subnormal).
        Rows of block b < last: exp(G_last - G_e) exp(G_e - G_i), the strip factors (each 0 or >= 1e-15: the
        product is 0 or >= 1e-30, never subnormal, and dropped terms are bounded as the strips' are), no exp."""
        G = self.G
        if self.exact:
            return _exp_floored(G[..., -1:, :] - G)
        S = self.S
        E = torch.empty_like(G)
        _exp_floored(torch.sub(G[..., -1:, :], G[..., -S:, :], out=E[..., -S:, :]))
        for j, (P_s, Q_s) in enumerate(self.strips):
            torch.mul(Q_s, P_s[..., -1:, :], out=E[..., j * S : (j + 1) * S, :])
        return E

    def gamma(self) -> torch.Tensor:
        """Gam = exp(G) [..., C, K] (<= 1 for g <= 0; < 1e-30 flushed to 0)."""
        return _exp_floored(self.G.clone())


# --------------------------------------------------------------------------------------------------------------
# the autograd node
# --------------------------------------------------------------------------------------------------------------
# chunks per group: per-tensor group slices of about this many bytes keep one group's working set (~30 tensors)
# in L3; smaller groups pay more per-op dispatch than they save (measured on the benchmark machine: 4 and 8
# chunks of 64 per group tie, 2 and 16 are 10-20% slower)
GROUP_BYTES = 256 * 1024


def _forward_group(q, k, X0, G, beta, S_all, n0: int, S: int) -> tuple[torch.Tensor, list]:
    """Forward of chunks n0..n0+len(q): q (scaled), k [n, X, C, K], G = cumsum(g) [n, X, C, K], beta [n, X, C] and
    X0 [n, X, C, K + V] holding v in its right half (the left half receives kg here). Reads the state S_all[n0],
    writes S_all[n0 + 1..]; returns the group's output [n, X, C, V] and what its backward needs."""
    N, K = q.shape[0], q.shape[-1]
    dec = _DecayFactors(G, S)
    qP, kP, kQ = dec.rows(q), dec.rows(k), dec.cols(k)
    A_qk = dec.scores(*qP, *kQ, diagonal=0)  # causal [C, C] per chunk, block form
    A_kk = dec.scores(*kP, *kQ, diagonal=-1)
    del qP, kP, kQ  # freed blocks are reused while still in cache (here and below)
    Gam = dec.gamma()  # exp(G); G itself is kept (in dec) and Gam recomputed in backward: as many saved bytes
    E = dec.last_row_decay()  # exp(G_last - G)
    qg = q * Gam
    torch.mul(k, Gam, out=X0[..., :K])  # X0 = [kg | v]
    beta1 = beta.unsqueeze(-1)
    scale = UT_SCALE[q.dtype]  # see UT_SCALE: no subnormal on any thread
    Tm = A_kk.scale_rows(beta, scale).unit_inverse(scale, math.exp(EXP_FLOOR[q.dtype]))  # (I + Diag(beta) A_kk)^-1
    Xb = torch.empty_like(X0)  # Diag(beta) [kg | v], kg times the scale
    torch.mul(X0[..., :K], beta1 * scale, out=Xb[..., :K])
    torch.mul(X0[..., K:], beta1, out=Xb[..., K:])
    WU = Tm.mm(Xb)  # [W | U] = T Diag(beta) [kg | v]
    del Xb
    W, U = _unscale_flushed(WU[..., :K], scale), WU[..., K:]  # strided views: BLAS takes them as they are
    d = Gam[..., -1, :].unsqueeze(-1)  # exp(G_last) [n, X, K, 1]
    Kd = k * E  # [n, X, C, K]
    Vp = torch.empty_like(U, memory_format=torch.contiguous_format)  # pseudo-values U - W S
    _state_forward(U, W, d, Kd, Vp, S_all[n0 : n0 + N + 1])
    del Kd, E
    o = A_qk.mm(Vp, acc=qg @ S_all[n0 : n0 + N])
    # cheap products are recomputed in the backward: saving them costs more (DRAM traffic). Q becomes None, not
    # deleted: the saved structure (`_tensor_slots`) must be the same in the backward
    dec.Q = None  # type: ignore[assignment]
    return o, [q, k, beta, None, X0, WU, Vp, dec, A_qk, A_kk, Tm]


def _state_forward(U, W, d, Kd, Vp, S_n) -> None:
    """The sequential part: Vp_i = U_i - W_i S_i into Vp, S_{i+1} = d_i S_i + Kd_i^T Vp_i into S_n[i + 1]."""
    S_n = S_n.unbind(0)  # one call for all the per-chunk views the loop needs
    for U_i, W_i, d_i, KdT_i, Vp_i, S_i, S_next in zip(
        U.unbind(0), W.unbind(0), d.unbind(0), Kd.transpose(-1, -2).unbind(0), Vp.unbind(0), S_n, S_n[1:]
    ):
        torch.baddbmm(U_i, W_i, S_i, alpha=-1, out=Vp_i)
        torch.baddbmm(d_i * S_i, KdT_i, Vp_i, out=S_next)


def _state_backward(dVp, Kd, d, W, dS_n) -> None:
    """Its backward, last chunk first: dVp_i += Kd_i dS_{i+1}, dS_i += d_i dS_{i+1} - W_i^T dVp_i (dS_n[i] holds
    the output path's term on entry)."""
    dS_n = dS_n.unbind(0)
    for dVp_i, Kd_i, d_i, WT_i, dS_i, dS_next in list(
        zip(dVp.unbind(0), Kd.unbind(0), d.unbind(0), W.transpose(-1, -2).unbind(0), dS_n, dS_n[1:])
    )[::-1]:
        dVp_i.baddbmm_(Kd_i, dS_next)
        dS_i.addcmul_(d_i, dS_next).baddbmm_(WT_i, dVp_i, alpha=-1)


def _backward_group(saved: list, S_all, dS_all, n0: int, do, outs) -> None:
    """Backward of one group (groups run last to first): reads dS_all[n0 + n], writes dS_all[n0..n0 + n - 1] and
    the group's slices of the input gradients `outs` = (dq, dk, dv, dg, dbeta) (dq: of the scaled q)."""
    q, k, beta, _, X0, WU, Vp, dec, A_qk, A_kk, Tm = saved
    N, K = q.shape[0], q.shape[-1]
    dec.Q = torch.reciprocal(dec.P) if not dec.exact else None  # type: ignore[assignment]
    Gam = dec.gamma()
    qg = q * Gam
    E = dec.last_row_decay()
    Kd = k * E
    W, U = WU[..., :K], WU[..., K:]
    kg, v = X0[..., :K], X0[..., K:]
    S_prev, S_next = S_all[n0 : n0 + N], S_all[n0 + 1 : n0 + N + 1]
    dq_o, dk_o, dv_o, dg_o, dbeta_o = outs

    # output o = qg S_prev + A_qk Vp
    dA_qk = BlockLower.outer([(do, Vp, 1.0)], dec.n_s, diagonal=0)
    dVp = A_qk.mm_t(do)  # becomes the total gradient of Vp in the loop
    dqg = do @ S_prev.transpose(-1, -2)
    torch.matmul(qg.transpose(-1, -2), do, out=dS_all[n0 : n0 + N])
    del qg
    _state_backward(dVp, Kd, Gam[..., -1, :].unsqueeze(-1), W, dS_all[n0 : n0 + N + 1])
    del Kd
    dS_next = dS_all[n0 + 1 : n0 + N + 1]
    dKd = Vp @ dS_next.transpose(-1, -2)  # [n, X, C, K]
    # whole-chunk decay exp(G_last) of the state path: sum_V dS_{n+1} S_{n+1} to every position (see dg)
    dG_last = (dS_next * S_next).sum(-1)  # [n, X, K]

    # UT transform: [W | U] = T Diag(beta) [kg | v]; dU = dVp, dW = -dVp S^T, so T^T dW = -(T^T dU) S^T
    dRU = Tm.mm_t(dVp)  # T^T dU  [n, X, C, V]
    nRW = dRU @ S_prev.transpose(-1, -2)  # -T^T dW  [n, X, C, K]
    dL = BlockLower.outer([(nRW, W, 1.0), (dRU, U, -1.0)], dec.n_s, diagonal=-1)  # grad of Diag(beta) A_kk
    beta1 = beta.unsqueeze(-1)
    torch.sum(dRU * v, -1, out=dbeta_o)
    dbeta_o.sub_((nRW * kg).sum(-1)).add_(dL.row_dot(A_kk))
    torch.mul(dRU, beta1, out=dv_o)
    del dRU, dVp
    ndkg = nRW.mul_(beta1)  # minus the gradient of kg
    dA_kk = dL.scale_rows_(beta)
    qP, kP, kQ = dec.rows(q), dec.rows(k), dec.cols(k)

    # decayed scores
    dq = dec.row_apply(dA_qk, *kQ, out=dq_o)
    dk_row = dec.row_apply(dA_kk, *kQ)
    dk_col = dec.col_apply([dA_qk, dA_kk], [qP, kP])
    del qP, kP, kQ, dA_qk, dA_kk, dL
    # assemble: dq, dk, dG (dG_r = q dq + k (row-side terms) - k (column-side terms))
    dq.addcmul_(Gam, dqg)
    dk_pos = dk_row.addcmul_(Gam, ndkg, value=-1)  # + kg path
    dk_neg = dk_col.addcmul_(E, dKd)  # + Kd path (exp(G_last - G))
    dG = q * dq
    dG.addcmul_(k, dk_pos).addcmul_(k, dk_neg, value=-1)
    torch.add(dk_pos, dk_neg, out=dk_o)
    # dg_r = sum_{r' >= r} dG_r' + dG_last = (cumsum_last + dG_last) - cumsum_r + dG_r
    cs = dG.cumsum(-2)
    total = cs[..., -1:, :] + dG_last.unsqueeze(-2)  # [n, X, 1, K]
    torch.sub(total, cs, out=dg_o).add_(dG)


def _group_view(x: torch.Tensor, n0: int, n1: int, C: int) -> torch.Tensor:
    """[B, T, H, D] -> view [n, B, H, C, D] of chunks n0..n1 (chunk-major; B, H merge into X on reshape)."""
    B, _, H, D = x.shape
    return x[:, n0 * C : n1 * C].view(B, n1 - n0, C, H, D).permute(1, 0, 3, 2, 4)


def _tensor_slots(obj):
    """(container, key) of every tensor slot (a tensor or None) in a group's saved list, its factor and block
    objects included, so that all of them go through ctx.save_for_backward (saved-tensor hooks: memory
    accounting, checkpointing). The structure is never changed, so the slots come in the same order again."""
    items = enumerate(obj) if isinstance(obj, list) else vars(obj).items()
    for key, x in items:
        if x is None or isinstance(x, torch.Tensor):
            yield obj, key
        elif isinstance(x, (list, _DecayFactors, BlockLower)):
            yield from _tensor_slots(x)


def _get(container, key):
    return container[key] if isinstance(container, list) else getattr(container, key)


def _set(container, key, value) -> None:
    if isinstance(container, list):
        container[key] = value
    else:
        setattr(container, key, value)


class ChunkKDA(torch.autograd.Function):
    """(q, k, v, g, beta, S0, C, S, scale) -> (o [B, T, H, V], S_N [X, K, V]) for q, k, g [B, T, H, K],
    v [B, T, H, V], beta [B, T, H] with T a multiple of the chunk size C, S0 [X = B * H, K, V]. S: the sub-block
    size (`sub_block_size`); q comes unscaled, o is the attention of (scale q) (scaled while copied in).

    Chunks are processed in groups of about `GROUP_BYTES` per tensor (forward first to last, backward last to
    first, the state carried between groups); each group is copied into the chunk-major layout [n, X, C, D] when
    it is needed, and its results are written back to [B, T, H, D] while they are still in cache."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, C: int, S: int, scale: float):
        with flush_denormals():
            return ChunkKDA._forward(ctx, q, k, v, g, beta, S0, C, S, scale)

    @staticmethod
    def _forward(ctx, q, k, v, g, beta, S0, C: int, S: int, scale: float):
        B, T, H, K = q.shape
        V = v.shape[-1]
        X, N = B * H, T // C
        step = max(1, GROUP_BYTES // max(X * C * K * q.element_size(), 1))
        S_all = q.new_empty(N + 1, *S0.shape)  # states at chunk starts, and the final one
        S_all[0] = S0
        o = v.new_empty(v.shape)
        ctx.groups = []
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            n = n1 - n0
            # chunk-major contiguous copies, fused with the first op on each input where there is one
            q_g, k_g, G_g = (q.new_empty(n, X, C, K) for _ in range(3))
            X0 = q.new_empty(n, X, C, K + V)  # [kg | v]
            beta_g = q.new_empty(n, X, C)
            torch.mul(_group_view(q, n0, n1, C), scale, out=q_g.view(n, B, H, C, K))
            k_g.view(n, B, H, C, K).copy_(_group_view(k, n0, n1, C))
            X0[..., K:].view(n, B, H, C, V).copy_(_group_view(v, n0, n1, C))
            torch.cumsum(_group_view(g, n0, n1, C), -2, out=G_g.view(n, B, H, C, K))
            beta_g.view(n, B, H, C, 1).copy_(_group_view(beta.unsqueeze(-1), n0, n1, C))
            o_g, saved = _forward_group(q_g, k_g, X0, G_g, beta_g, S_all, n0, S)
            _group_view(o, n0, n1, C).copy_(o_g.view(n, B, H, C, V))
            ctx.groups.append((n0, n1, saved))
        ctx.C, ctx.BH, ctx.scale = C, (B, H), scale
        tensors = []  # the groups keep their structure; their tensors travel through save_for_backward
        for _, _, saved in ctx.groups:
            for container, key in _tensor_slots(saved):
                tensors.append(_get(container, key))
                _set(container, key, None)
        ctx.save_for_backward(S_all, *tensors)
        return o, S_all[N].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS_N):
        with flush_denormals():
            return ChunkKDA._backward(ctx, do, dS_N)

    @staticmethod
    def _backward(ctx, do, dS_N):
        S_all, *tensors = ctx.saved_tensors
        slots = [slot for _, _, saved in ctx.groups for slot in _tensor_slots(saved)]
        for (container, key), t in zip(slots, tensors):  # the slots are the ones emptied in forward, in order
            _set(container, key, t)
        N = S_all.shape[0] - 1
        C, (B, H) = ctx.C, ctx.BH
        q = ctx.groups[0][2][0]
        X, K, V = S_all.shape[1:]
        T = N * C
        dS_all = torch.empty_like(S_all)  # gradient of every state S_0..S_N
        dS_all[N] = 0 if dS_N is None else dS_N
        dq, dk, dg = (q.new_empty(B, T, H, K) for _ in range(3))
        dv = q.new_empty(B, T, H, V)
        dbeta = q.new_empty(B, T, H)
        for n0, n1, saved in reversed(ctx.groups):
            n = n1 - n0
            do_g = q.new_empty(n, X, C, V)
            if do is None:
                do_g.zero_()
            else:
                do_g.view(n, B, H, C, V).copy_(_group_view(do, n0, n1, C))
            outs = tuple(q.new_empty(n, X, C, D) for D in (K, K, V, K)) + (q.new_empty(n, X, C),)
            _backward_group(saved, S_all, dS_all, n0, do_g, outs)
            # q entered scaled: dq = scale * (gradient of the scaled q)
            torch.mul(outs[0].view(n, B, H, C, K), ctx.scale, out=_group_view(dq, n0, n1, C))
            for full, g_ in zip((dk, dv, dg), outs[1:4]):
                _group_view(full, n0, n1, C).copy_(g_.view(n, B, H, C, -1))
            _group_view(dbeta.unsqueeze(-1), n0, n1, C).copy_(outs[4].view(n, B, H, C, 1))
        return dq, dk, dv, dg, dbeta, dS_all[0], None, None, None
