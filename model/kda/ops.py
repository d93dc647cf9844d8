"""Kimi Delta Attention kernels: `chunk_kda` (training / prefill) and `recurrent_kda` (decode).

Both follow fla's `chunk_kda` / `fused_recurrent_kda` signature and conventions, so the GPU path can dispatch to
fla's Triton kernels unchanged:

    q, k: [B, T, H, K] (already L2-normalised)   v: [B, T, H, V]   g: [B, T, H, K] log-space decay (<= 0)
    beta: [B, T, H] in (0, 1)                    state: [N, H, K, V] (N = B, or the number of cu_seqlens segments)

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T (scale * q_t)

Everything is computed in (at least) fp32 and `o` is returned in q's dtype; the state is fp32 (fp64 for fp64
inputs). On CPU the chunked path is the WY/UT algorithm of docs/model.md §3 in plain PyTorch, one autograd node with a
hand-written backward (model/kda/chunk.py):

1. intra-chunk work is batched over [chunks, B*H, C, ...]: decayed scores A_qk / A_kk, and W, U from the inverse
   of the unit-triangular UT matrix (blockwise: small batched matmuls beat batched LAPACK solves on CPU);
2. only the state recurrence runs sequentially, two small matmuls per chunk (T / C steps, never per token);
3. chunks stream through forward and backward in groups small enough to stay in cache.

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

from model.kda.chunk import ChunkKDA, sub_block_size
from model.kda.naive import naive_recurrent_kda


# --------------------------------------------------------------------------------------------------------------
# input checks and varlen packing
# --------------------------------------------------------------------------------------------------------------
def _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size: int | None, cu_host=None) -> int:
    """Validate shapes; return N, the number of sequences (B, or the number of cu_seqlens segments). `cu_host`:
    the same boundaries already on the host (a list or CPU tensor), read instead of cu_seqlens (no device sync)."""
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
        cu = _host_list(cu_seqlens, cu_host)
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must be nondecreasing from 0 to T={T}, got {cu}")
        N = len(cu) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {v.shape[-1]}], got {tuple(initial_state.shape)}"
        )
    return N


def _host_list(cu_seqlens: torch.Tensor, cu_host) -> list[int]:
    """The boundaries as Python ints: from the host copy when the caller has one, else one device read."""
    if cu_host is None:
        return cu_seqlens.tolist()
    return cu_host.tolist() if isinstance(cu_host, torch.Tensor) else [int(c) for c in cu_host]


def _compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _pack(x: torch.Tensor, index_NT: torch.Tensor, valid_NT: torch.Tensor) -> torch.Tensor:
    """[1, T, ...] packed documents -> [N, T_max, ...] padded batch with zero (no-op) rows."""
    y = x[0, index_NT]
    mask = valid_NT.view(*valid_NT.shape, *([1] * (y.dim() - 2)))
    return torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))


def _varlen_layout(
    cu_seqlens: torch.Tensor, device: torch.device, cu_host: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index [N, T_max] into the packed sequence and the mask of real (non-padding) rows."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    if cu_host is not None:
        t_max = max(max((b - a for a, b in zip(cu_host, cu_host[1:])), default=1), 1)
    else:
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
        from fla.ops.kda import chunk_kda as fla_chunk  # type: ignore
        from fla.ops.kda import fused_recurrent_kda as fla_recurrent
    except Exception:  # noqa: BLE001 - any import failure (no fla, no triton) means: use the PyTorch path
        return None
    return fla_chunk, fla_recurrent


def _use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype != torch.float64 and _fla_kda() is not None


# --------------------------------------------------------------------------------------------------------------
# recurrent form (decode): fla's fused kernel on CUDA, else the reference loop of model/kda/naive.py
# --------------------------------------------------------------------------------------------------------------
def _recurrent_core(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV, scale: float):
    """`naive_recurrent_kda` in `_run`'s core convention (inputs already in the compute dtype, state given)."""
    return naive_recurrent_kda(
        q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=scale, initial_state=S_BHKV, output_final_state=True
    )


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA, one token per step (decode). Same arguments as `chunk_kda`; `chunk_size` is ignored.

    On CUDA with fla: fla's `fused_recurrent_kda`. Elsewhere: the reference loop (model/kda/naive.py) behind the
    same input checks, dtype policy and `cu_seqlens` unpacking as `chunk_kda` (a decode step has T = 1, where no
    chunked form is faster).
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens, None)
    if _use_fla(q):
        fla_recurrent = _fla_kda()[1]
        return fla_recurrent(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )
    return _run(_recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


# --------------------------------------------------------------------------------------------------------------
# chunked form (the maths and its backward: model/kda/chunk.py)
# --------------------------------------------------------------------------------------------------------------
def _chunk_core(
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV, scale: float, chunk_size: int, lower_bound: float | None = None
):
    """WY/UT chunked delta rule (docs/model.md §3) in the compute dtype; the kernel applies the query scale.
    `lower_bound`: g is known to lie in [lower_bound, 0] (the K3 gate), so the sub-block size follows from it
    instead of from the data (which would read max|g| on the host: a device sync per layer)."""
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    if pad:  # no-op rows: k = 0, beta = 0, g = 0 leave the state untouched
        q_BTHK, k_BTHK, g_BTHK, v_BTHV = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q_BTHK, k_BTHK, g_BTHK, v_BTHV))
        beta_BTH = F.pad(beta_BTH, (0, 0, 0, pad))

    S0_XKV = S_BHKV.reshape(B * H, K, V)
    if lower_bound is not None:
        max_abs_g = -float(lower_bound)
    else:  # positive g (growth) is outside the model's range; the exact form stays correct for it anyway
        g_min, g_max = torch.aminmax(g_BTHK.detach()) if g_BTHK.numel() else (g_BTHK.new_zeros(()),) * 2
        max_abs_g = float("inf") if float(g_max) > 0 else -float(g_min)
    S = sub_block_size(C, max_abs_g, q_BTHK.dtype)
    o_BTHV, S_XKV = ChunkKDA.apply(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S0_XKV, C, S, scale)
    return o_BTHV[:, :T], S_XKV.view(B, H, K, V)


def _run(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *args, cu_host=None):
    """Shared wrapper: dtype policy, scale, varlen packing into a padded batch, output dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = _compute_dtype(q, k, v, g, initial_state)
    scale = K**-0.5 if scale is None else scale
    q32, k32, v32, g32, b32 = (x.to(dt) for x in (q, k, v, g, beta))
    if cu_seqlens is not None:
        host = None if cu_host is None else _host_list(cu_seqlens, cu_host)
        index_NT, valid_NT = _varlen_layout(cu_seqlens, q.device, host)
        q32, k32, v32, g32, b32 = (_pack(x, index_NT, valid_NT) for x in (q32, k32, v32, g32, b32))
    n_seq = q32.shape[0]
    if initial_state is None:
        S0 = torch.zeros(n_seq, H, K, V, dtype=dt, device=q.device)
    else:
        S0 = initial_state.to(dt)
    o, S = core(q32, k32, v32, g32, b32, S0, float(scale), *args)
    if cu_seqlens is not None:
        o = o[valid_NT].unsqueeze(0)  # segments are contiguous and ordered: row-major order is the packed order
    return o.to(q.dtype).contiguous(), (S if output_final_state else None)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    lower_bound: float | None = None,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA (fla signature). Returns (o [B, T, H, V] in q's dtype, final state [N, H, K, V] or None).

    `cu_seqlens` (B == 1) marks packed documents: the state restarts from `initial_state[n]` (or zero) at every
    boundary and one final state per document is returned; `cu_seqlens_cpu` (the same boundaries on the host, a CPU
    tensor or list) spares the device read of them. `lower_bound`: the caller guarantees g >= lower_bound (the K3
    gate), which fixes the kernel's sub-block size without reading g. On CUDA with fla installed, fla's kernel runs
    instead (its own chunk size), given cu_seqlens on the device and cu_seqlens_cpu, so it reads no host copy.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, cu_seqlens_cpu)
    if _use_fla(q):
        fla_chunk = _fla_kda()[0]
        return fla_chunk(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            **_fla_host_boundaries(cu_seqlens, cu_seqlens_cpu),
        )
    return _run(
        _chunk_core,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        chunk_size,
        lower_bound,
        cu_host=cu_seqlens_cpu,
    )


def _fla_host_boundaries(cu_seqlens: torch.Tensor | None, cu_host) -> dict:
    """fla's `cu_seqlens_cpu` keyword (fla-core 0.6: spares its device->host copy) as a CPU int tensor."""
    if cu_seqlens is None:
        return {}
    host = cu_host if cu_host is not None else cu_seqlens.cpu()  # one read here where the caller has no copy
    if not isinstance(host, torch.Tensor):
        host = torch.tensor(host, dtype=cu_seqlens.dtype)
    return {"cu_seqlens_cpu": host.to(dtype=cu_seqlens.dtype)}
