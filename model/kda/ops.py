"""Kimi Delta Attention kernels: `chunk_kda` (training / prefill) and `recurrent_kda` (decode).

Both follow fla's `chunk_kda` / `fused_recurrent_kda` signature and conventions, so the GPU path can dispatch to
fla's Triton kernels unchanged:

    q, k: [B, T, H, K] (already L2-normalised)   v: [B, T, H, V]   g: [B, T, H, K] log-space decay (<= 0)
    beta: [B, T, H] in (0, 1)                    state: [N, H, K, V] (N = B, or the number of cu_seqlens segments)

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T (scale * q_t)

Everything is computed in (at least) fp32 and `o` is returned in q's dtype; the state is fp32 (fp64 for fp64
inputs). On CPU the chunked path is the WY/UT algorithm of spec §3 in plain PyTorch:

1. all chunks' intra-chunk work is batched over [N chunks, B*H, C, ...]: decayed scores A_qk / A_kk, and W, U
   from the inverse of the unit-triangular UT matrix, formed once by blocked halving (batched LAPACK solves of
   many small systems are several times slower than matmuls on CPU), with a matmul-only backward;
2. only the state recurrence runs sequentially, two small matmuls per chunk (T / C steps, never per token), with
   a hand-written backward so autograd records one node for the whole loop.

Decayed scores `sum_c a_r[c] exp(G_r[c] - G_i[c]) b_i[c]` are never materialised as [C, C, K] tensors when the
decay is bounded: within a sub-block of S rows the exponent is split at a reference row in the middle of the
sub-block, `exp(G_r - G_ref) * exp(G_ref - G_i)`, and S is chosen so each factor stays in the float range for every
entry the causal mask keeps ((S // 2) * max|g| <= 80 in fp32: the K3 gate bound g > -5 allows S = 32, so chunks
of 16 or 32 are one block and a chunk of 64 is two). Unbounded gates (Kimi-Linear form) that would overflow get
smaller sub-blocks or, past that, the exact difference form, so correctness never depends on the gate bound.
g > 0 (growth) is outside the model's range and always takes the exact form.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# largest exponent one score factor may carry (fp32 max ~ e^88.7)
_EXP_LIMIT = {torch.float32: 80.0, torch.float64: 600.0}
# smallest exponent worth evaluating: below it exp() is subnormal / zero, and CPU exp takes a ~30x slower path there
_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -700.0}


class _FloorExp(torch.autograd.Function):
    """exp(x) with x floored at the smallest normal exponent: changes values (and gradients, d exp = exp) by
    < 2e-38, and keeps CPU exp off its ~30x slower subnormal path. Backward is one multiply (no clamp mask)."""

    @staticmethod
    def forward(ctx, x):
        y = x.clamp(min=_EXP_FLOOR[x.dtype]).exp_()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return dy * y


def _exp(x: torch.Tensor) -> torch.Tensor:
    return _FloorExp.apply(x)


# --------------------------------------------------------------------------------------------------------------
# input checks and varlen packing
# --------------------------------------------------------------------------------------------------------------
def _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size: int | None) -> int:
    """Validate shapes; return N, the number of sequences (B, or the number of cu_seqlens segments)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}; add the head dimension")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g (log decay per key channel) must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (packed sequences), got B={B}; flatten the batch first")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be a 1-D integer tensor [N+1] of cumulative lengths starting at 0")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must be nondecreasing from 0 to T={T}, got {cu}")
        N = len(cu) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {v.shape[-1]}], "
                         f"got {tuple(initial_state.shape)}")
    return N


def _compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _pack(x: torch.Tensor, index_NT: torch.Tensor, valid_NT: torch.Tensor) -> torch.Tensor:
    """[1, T, ...] packed documents -> [N, T_max, ...] padded batch with zero (no-op) rows."""
    y = x[0, index_NT]
    mask = valid_NT.view(*valid_NT.shape, *([1] * (y.dim() - 2)))
    return torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))


def _varlen_layout(cu_seqlens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index [N, T_max] into the packed sequence and the mask of real (non-padding) rows."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    t_max = max(int(lengths.max()), 1)
    t_T = torch.arange(t_max, device=device)
    valid_NT = t_T[None, :] < lengths[:, None]
    index_NT = torch.where(valid_NT, cu[:-1, None] + t_T[None, :], torch.zeros_like(valid_NT, dtype=torch.long))
    return index_NT, valid_NT


# --------------------------------------------------------------------------------------------------------------
# fla dispatch (CUDA only, optional)
# --------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _fla_kda():
    """fla's (chunk_kda, fused_recurrent_kda) or None; fla needs Triton, so this is only tried for CUDA tensors."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent  # type: ignore
    except Exception:  # noqa: BLE001 - any import failure (no fla, no triton) means: use the PyTorch path
        return None
    return fla_chunk, fla_recurrent


def _use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float64 and _fla_kda() is not None


# --------------------------------------------------------------------------------------------------------------
# recurrent form (decode, and the peer of the benchmark)
# --------------------------------------------------------------------------------------------------------------
def _recurrent_core(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV):
    """Token-by-token delta rule in the compute dtype; q already scaled. Returns o [B, T, H, V], S [B, H, K, V]."""
    T = q_BTHK.shape[1]
    alpha_BTHK = g_BTHK.exp()
    outs = []
    for t in range(T):
        k_BHK = k_BTHK[:, t]
        S_BHKV = S_BHKV * alpha_BTHK[:, t, :, :, None]  # S' = Diag(alpha) S
        kS_BHV = (k_BHK.unsqueeze(-2) @ S_BHKV).squeeze(-2)  # S'^T k
        delta_BHV = beta_BTH[:, t, :, None] * (v_BTHV[:, t] - kS_BHV)
        S_BHKV = S_BHKV + k_BHK.unsqueeze(-1) * delta_BHV.unsqueeze(-2)
        outs.append((q_BTHK[:, t].unsqueeze(-2) @ S_BHKV).squeeze(-2))
    o_BTHV = torch.stack(outs, dim=1) if outs else v_BTHV.new_zeros(v_BTHV.shape)
    return o_BTHV, S_BHKV


def recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float | None = None, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                  chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA, one token per step (decode). Same arguments as `chunk_kda`; `chunk_size` is ignored."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, None)
    if _use_fla(q):
        fla_recurrent = _fla_kda()[1]
        return fla_recurrent(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return _run(_recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


# --------------------------------------------------------------------------------------------------------------
# chunked form
# --------------------------------------------------------------------------------------------------------------
def _sub_block_size(C: int, max_abs_g: float, dtype: torch.dtype) -> int:
    """Largest divisor S of C whose half-block stays in range, (S // 2) * max|g| <= limit, or 0 (exact form)."""
    limit = _EXP_LIMIT[dtype]
    for S in range(C, 1, -1):
        if C % S == 0 and (S // 2) * max_abs_g <= limit:
            return S
    return 0


def _decayed_scores(q_XCK, k_XCK, G_XCK, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A_qk[r, i] = sum_c q_r exp(G_r - G_i) k_i (i <= r) and A_kk (same with k_r, i < r), both [..., C, C].

    S > 0: the exponent is split at a reference row in the middle of each sub-block of S rows,
    exp(G_r - G_ref) * exp(G_ref - G_i), so both factors stay below exp((S // 2) max|g|) for every entry the
    causal mask keeps (their product is <= 1). Entries the mask drops may overflow (inf / nan); `tril` replaces
    them by zeros and their gradient is zero. S == 0: the exact difference form over [..., C, C, K].
    """
    C, K = q_XCK.shape[-2:]
    lead = G_XCK.shape[:-2]
    if S == 0:
        diff_XCCK = G_XCK.unsqueeze(-2) - G_XCK.unsqueeze(-3)  # [..., r, i, K] = G_r - G_i
        causal_CC = torch.ones(C, C, dtype=torch.bool, device=G_XCK.device).tril()
        decay_XCCK = torch.where(causal_CC[:, :, None], diff_XCCK, torch.full_like(diff_XCCK, -torch.inf)).exp()
        kd_XCCK = decay_XCCK * k_XCK.unsqueeze(-3)
        A_qk = torch.einsum("...rc,...ric->...ri", q_XCK, kd_XCCK)
        A_kk = torch.einsum("...rc,...ric->...ri", k_XCK, kd_XCCK)
        return A_qk, A_kk.tril(-1)
    n_s = C // S
    G_XnSK = G_XCK.view(*lead, n_s, S, K)
    # reference row of each sub-block; the product of the two factors does not depend on it: detached
    ref_XnK = G_XnSK.detach()[..., S // 2, :]
    row_XnSK = (G_XnSK - ref_XnK.unsqueeze(-2)).exp()  # |exponent| <= (S // 2) max|g| <= limit
    if n_s == 1:  # one block; the column factor is its own exp (1 / row would give a backward of inf * 0 = nan
        # for row factors near the range limit: d(1/r) = -1/r^2 overflows)
        row_XCK = row_XnSK.view_as(G_XCK)
        colT_XKC = (k_XCK * (ref_XnK - G_XCK).exp()).transpose(-1, -2)
        return ((q_XCK * row_XCK) @ colT_XKC).tril(), ((k_XCK * row_XCK) @ colT_XKC).tril(-1)
    if n_s == 2:
        return _decayed_scores_two_blocks(q_XCK, k_XCK, G_XCK)
    # columns of later sub-blocks are masked anyway: clamp them so the factor stays finite
    col_exp_XnCK = ref_XnK.unsqueeze(-2) - G_XCK.unsqueeze(-3)
    col_XnCK = col_exp_XnCK.clamp(max=_EXP_LIMIT[G_XCK.dtype]).exp() * k_XCK.unsqueeze(-3)
    rows_Xn2SK = torch.cat([q_XCK.view(*lead, n_s, S, K) * row_XnSK, k_XCK.view(*lead, n_s, S, K) * row_XnSK], -2)
    A_Xn2SC = rows_Xn2SK @ col_XnCK.transpose(-1, -2)  # [..., n_s, 2S, C]
    A_qk = A_Xn2SC[..., :S, :].reshape(*lead, C, C).tril()
    A_kk = A_Xn2SC[..., S:, :].reshape(*lead, C, C).tril(-1)
    return A_qk, A_kk


def _decayed_scores_two_blocks(q_XCK, k_XCK, G_XCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`_decayed_scores` for two sub-blocks of S = C / 2 rows, built block by block (no [..., 2, C, K] factors).

    Diagonal blocks split the exponent at their middle row (both factors within exp(+-(S // 2) max|g|)); the
    off-diagonal block (rows of block 1, columns of block 0) splits it at the boundary row b = S - 1, where both
    factors exp(G_r - G_b) and exp(G_b - G_i) are <= 1, so flooring their exponents (`_exp`) is harmless. The
    product does not depend on the reference row, so the references are detached (same gradient, fewer nodes).
    """
    C, K = q_XCK.shape[-2:]
    S = C // 2
    lead = G_XCK.shape[:-2]
    q_X2SK, k_X2SK, G_X2SK = (x.view(*lead, 2, S, K) for x in (q_XCK, k_XCK, G_XCK))
    ref_X21K = G_X2SK.detach()[..., S // 2:S // 2 + 1, :]
    row_X2SK = (G_X2SK - ref_X21K).exp()  # |exponent| <= (S // 2) max|g| <= limit: no floor needed
    colT_X2KS = (k_X2SK * (ref_X21K - G_X2SK).exp()).transpose(-1, -2)
    Dq0, Dq1 = ((q_X2SK * row_X2SK) @ colT_X2KS).unbind(-3)  # [.., S, S] diagonal blocks
    Dk0, Dk1 = ((k_X2SK * row_X2SK) @ colT_X2KS).unbind(-3)
    q1, k0, k1, G0, G1 = q_X2SK[..., 1, :, :], *k_X2SK.unbind(-3), *G_X2SK.unbind(-3)
    G_b_X1K = G0.detach()[..., S - 1:S, :]  # boundary row: last row of block 0
    row_off_XSK = _exp(G1 - G_b_X1K)  # <= 1
    col_offT_XKS = (k0 * _exp(G_b_X1K - G0)).transpose(-1, -2)  # <= 1
    Oq = (q1 * row_off_XSK) @ col_offT_XKS  # [.., S, S] rows of block 1, columns of block 0
    Ok = (k1 * row_off_XSK) @ col_offT_XKS

    def assemble(D0, O, D1, diagonal: int) -> torch.Tensor:  # [.., C, C] from the three blocks
        return torch.cat([F.pad(D0.tril(diagonal), (0, S)), torch.cat([O, D1.tril(diagonal)], dim=-1)], dim=-2)

    return assemble(Dq0, Oq, Dq1, 0), assemble(Dk0, Ok, Dk1, -1)


def _inter_chunk_forward(WU_NXCD, d_NXK1, KdT_NXKC, S0_XKV):
    """The only sequential part of the chunked form, for chunks n = 0..N-1 (leading dim), batch X = B*H:

        Vp_n = U_n - W_n S_n                     pseudo-values            [X, C, V]
        S_{n+1} = Diag(d_n) S_n + Kd_n^T Vp_n    d_n = exp(G_last), Kd = k exp(G_last - G)

    WU = [W | U] [N, X, C, K + V] (column slices go to BLAS as strided views, no copies). Returns all states
    S_0..S_N [N+1, X, K, V] and Vp [N, X, C, V] (no autograd: callers own the backward).
    """
    N = WU_NXCD.shape[0]
    K = S0_XKV.shape[-2]
    W_NXCK, U_NXCV = WU_NXCD[..., :K], WU_NXCD[..., K:]
    S_all = WU_NXCD.new_empty(N + 1, *S0_XKV.shape)
    Vp_NXCV = torch.empty_like(U_NXCV, memory_format=torch.contiguous_format)
    S_all[0] = S0_XKV
    for n in range(N):
        torch.baddbmm(U_NXCV[n], W_NXCK[n], S_all[n], alpha=-1, out=Vp_NXCV[n])
        torch.baddbmm(d_NXK1[n] * S_all[n], KdT_NXKC[n], Vp_NXCV[n], out=S_all[n + 1])
    return S_all, Vp_NXCV


def _inter_chunk_backward(WU_NXCD, d_NXK1, KdT_NXKC, S_all, Vp_NXCV, dS_prev, dS_final, dVp_NXCV):
    """Reverse of `_inter_chunk_forward`: the same two matmuls per chunk, every other gradient batched after.

    Returns d[W | U] as one [N, X, C, K + V] tensor (dU is the total gradient of Vp)."""
    N = WU_NXCD.shape[0]
    K = S_all.shape[-2]
    W_NXCK = WU_NXCD[..., :K]
    S_prev = S_all[:N]
    dVp_tot = torch.empty_like(Vp_NXCV)  # total gradient of each Vp_n (direct + through S_{n+1})
    dS_all = torch.empty_like(S_all)  # dS_all[n] = gradient of S_n (all paths)
    dS_all[N] = dS_final
    for n in range(N - 1, -1, -1):
        torch.baddbmm(dVp_NXCV[n], KdT_NXKC[n].transpose(-1, -2), dS_all[n + 1], out=dVp_tot[n])
        torch.baddbmm(torch.addcmul(dS_prev[n], d_NXK1[n], dS_all[n + 1]), W_NXCK[n].transpose(-1, -2), dVp_tot[n],
                      alpha=-1, out=dS_all[n])
    dS_next = dS_all[1:]
    dS_XKV = dS_all[0]
    dWU = torch.cat([(dVp_tot @ S_prev.transpose(-1, -2)).neg_(), dVp_tot], dim=-1)
    dd = (dS_next * S_prev).sum(-1, keepdim=True)
    dKdT = dS_next @ Vp_NXCV.transpose(-1, -2)
    return dWU, dd, dKdT, dS_XKV


class _InterChunkRecurrence(torch.autograd.Function):
    """Autograd wrapper of the inter-chunk loop (hand-written backward: no per-step autograd nodes).

    Returns the chunk-initial states S_0..S_{N-1} [N, X, K, V], the final state S_N [X, K, V] and Vp [N, X, C, V].
    """

    @staticmethod
    def forward(ctx, WU_NXCD, d_NXK1, KdT_NXKC, S0_XKV):
        N = WU_NXCD.shape[0]
        S_all, Vp_NXCV = _inter_chunk_forward(WU_NXCD, d_NXK1, KdT_NXKC, S0_XKV)
        ctx.save_for_backward(WU_NXCD, d_NXK1, KdT_NXKC, S_all, Vp_NXCV)
        return S_all[:N], S_all[N].clone(), Vp_NXCV

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dS_prev, dS_final, dVp_NXCV):
        WU_NXCD, d_NXK1, KdT_NXKC, S_all, Vp_NXCV = ctx.saved_tensors
        N = WU_NXCD.shape[0]
        dS_prev = torch.zeros_like(S_all[:N]) if dS_prev is None else dS_prev
        dS_final = torch.zeros_like(S_all[N]) if dS_final is None else dS_final
        dVp_NXCV = torch.zeros_like(Vp_NXCV) if dVp_NXCV is None else dVp_NXCV
        return _inter_chunk_backward(WU_NXCD, d_NXK1, KdT_NXKC, S_all, Vp_NXCV, dS_prev, dS_final, dVp_NXCV)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (a permuted gradient would send the
    batched matmul backward into a per-matrix fallback)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx.contiguous()


def _unit_lower_inverse(L_XCC: torch.Tensor, leaf: int = 8) -> torch.Tensor:
    """(I + L)^-1 for strictly lower L [..., C, C], no autograd. Halves recursively (both diagonal halves in one
    batched call; the off-diagonal block is -T22 L21 T11) down to `leaf`-sized triangular solves against I:
    small batched matmuls are much faster on CPU than batched LAPACK solves of the full size."""
    C = L_XCC.shape[-1]
    if C <= leaf or C % 2:
        eye_CC = torch.eye(C, dtype=L_XCC.dtype, device=L_XCC.device).expand_as(L_XCC)
        return torch.linalg.solve_triangular(L_XCC, eye_CC, upper=False, unitriangular=True)
    h = C // 2
    T_X2hh = _unit_lower_inverse(torch.stack([L_XCC[..., :h, :h], L_XCC[..., h:, h:]], dim=-3), leaf)
    T11, T22 = T_X2hh.unbind(-3)
    T_XCC = L_XCC.new_zeros(L_XCC.shape)
    T_XCC[..., :h, :h] = T11
    T_XCC[..., h:, h:] = T22
    T_XCC[..., h:, :h] = -(T22 @ (L_XCC[..., h:, :h] @ T11))
    return T_XCC


class _UnitLowerSolve(torch.autograd.Function):
    """X = (I + L)^-1 R for strictly lower L [..., C, C] (the UT transform), via the explicit inverse.

    Batched LAPACK triangular solves of many small systems run at a fraction of matmul speed on CPU: the inverse
    (one solve against I, C right-hand sides) is formed once and reused, so the forward and the backward
    (dR = T^T dX, dL = -tril(dR X^T, -1)) are matmuls.
    """

    @staticmethod
    def forward(ctx, L_XCC, R_XCD):
        T_XCC = _unit_lower_inverse(L_XCC)
        X_XCD = T_XCC @ R_XCD
        ctx.save_for_backward(T_XCC, X_XCD)
        return X_XCD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dX_XCD):
        T_XCC, X_XCD = ctx.saved_tensors
        dR_XCD = T_XCC.transpose(-1, -2) @ dX_XCD
        dL_XCC = (dR_XCD @ X_XCD.transpose(-1, -2)).tril_(-1).neg_()
        return dL_XCC, dR_XCD


def _chunk_core(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV, chunk_size: int):
    """WY/UT chunked delta rule (spec §3) in the compute dtype; q already scaled."""
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    if pad:  # no-op rows: k = 0, beta = 0, g = 0 leave the state untouched
        q_BTHK, k_BTHK, g_BTHK, v_BTHV = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q_BTHK, k_BTHK, g_BTHK, v_BTHV))
        beta_BTH = F.pad(beta_BTH, (0, 0, 0, pad))

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, N*C, H, D] -> [N, B*H, C, D] (chunk-major, X = B*H)
        return x.view(B, N, C, H, x.shape[-1]).permute(1, 0, 3, 2, 4).reshape(N, B * H, C, x.shape[-1])

    def unchunk(o_NXCV: torch.Tensor) -> torch.Tensor:
        return o_NXCV.view(N, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]

    q, k, v, g = chunks(q_BTHK), chunks(k_BTHK), chunks(v_BTHV), chunks(g_BTHK)
    beta_NXC = chunks(beta_BTH.unsqueeze(-1)).squeeze(-1)
    S0_XKV = S_BHKV.reshape(B * H, K, V)
    # positive g (growth) is outside the model's range; the exact form stays correct for it anyway
    g_min, g_max = torch.aminmax(g.detach()) if g.numel() else (g.new_zeros(()), g.new_zeros(()))
    max_abs_g = float("inf") if float(g_max) > 0 else -float(g_min)
    G = g.cumsum(-2)  # [N, X, C, K] cumulative log decay inside each chunk
    A_qk, A_kk = _decayed_scores(q, k, G, _sub_block_size(C, max_abs_g, G.dtype))
    eG = _exp(G)  # <= 1
    qg, kg = q * eG, k * eG

    # UT transform: (I + Diag(beta) A_kk) [W U] = Diag(beta) [exp(G) K, V]
    rhs = torch.cat([kg, v], dim=-1) * beta_NXC.unsqueeze(-1)
    WU = _UnitLowerSolve.apply(A_kk * beta_NXC.unsqueeze(-1), rhs)

    # sequential part: one state step per chunk
    G_last_NXK = G[..., -1, :]
    d_NXK1 = _exp(G_last_NXK).unsqueeze(-1)
    KdT_NXKC = (k * _exp(G_last_NXK.unsqueeze(-2) - G)).transpose(-1, -2)
    S_prev_NXKV, S_XKV, Vp_NXCV = _InterChunkRecurrence.apply(WU, d_NXK1, KdT_NXKC, S0_XKV)
    o_NXCV = torch.baddbmm((qg @ S_prev_NXKV).flatten(0, 1), A_qk.flatten(0, 1), Vp_NXCV.flatten(0, 1))
    o_NXCV = _ContiguousGrad.apply(o_NXCV.view(N, B * H, C, V))
    return unchunk(o_NXCV), S_XKV.view(B, H, K, V)


def _run(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *args):
    """Shared wrapper: dtype policy, scale, varlen packing into a padded batch, output dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = _compute_dtype(q, k, v, g, initial_state)
    scale = K ** -0.5 if scale is None else scale
    q32, k32, v32, g32, b32 = (x.to(dt) for x in (q, k, v, g, beta))
    q32 = q32 * scale
    if cu_seqlens is not None:
        index_NT, valid_NT = _varlen_layout(cu_seqlens, q.device)
        q32, k32, v32, g32, b32 = (_pack(x, index_NT, valid_NT) for x in (q32, k32, v32, g32, b32))
    n_seq = q32.shape[0]
    if initial_state is None:
        S0 = torch.zeros(n_seq, H, K, V, dtype=dt, device=q.device)
    else:
        S0 = initial_state.to(dt)
    o, S = core(q32, k32, v32, g32, b32, S0, *args)
    if cu_seqlens is not None:
        o = o[valid_NT].unsqueeze(0)  # segments are contiguous and ordered: row-major order is the packed order
    return o.to(q.dtype).contiguous(), (S if output_final_state else None)


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
              chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA (fla signature). Returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] or None).

    `cu_seqlens` (B == 1) marks packed documents: the state restarts from `initial_state[n]` (or zero) at every
    boundary and one final state per document is returned. On CUDA with fla installed, fla's kernel runs instead
    (its own chunk size).
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    if _use_fla(q):
        fla_chunk = _fla_kda()[0]
        return fla_chunk(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return _run(_chunk_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
