"""The dispatch seam: how routed tokens reach their experts and come back.

A dispatcher computes, for N tokens routed to K experts each,

    u[n] = sum_k weight[n, k] * E_{idx[n, k]}(z[n])        (k summed in slot order 0..K-1, in >= fp32)

`LocalDispatcher` (all experts on this rank) is dropless and sort-based: a stable argsort of the N*K expert ids
groups the (token, slot) pairs by expert, every expert runs once on its contiguous rows (gathered block by block
inside the expert loop, model/moe/experts.py), and the results are combined per slot in (token, slot) order.
No capacity, no dropped tokens, no [N x E x C] tensors, no [N, K, l] copies.

It is one autograd node (`_LocalMoE`) with a hand-written backward that keeps only z [N, l], the weights and the
sort permutation, and recomputes the expert activations in backward: memory saved for backward is
N*l + O(N*K) instead of the several K*N*Im tensors a plain autograd graph keeps. With
`LocalDispatcher(recompute=False)` it also keeps the GLU inputs W1 z, W3 z (K*N*2*Im values, still < 0.5x what
DeepSpeed's MoE saves) and skips the two recomputation GEMMs (6 instead of 8 backward GEMMs per expert): ~10-15%
faster on CPU. The default stays recompute=True because the planner's memory model (training/tools/activation_memory.py)
assumes it.

An expert-parallel dispatcher (training/parallel/alltoall.py) plugs into `LatentMoE.dispatcher` with the same
call signature; it should group by expert with the same stable sort, run `experts.forward_grouped` on what it
receives, and combine with `combine_slots` so the k-summation order (and hence the bits) match.
"""

from __future__ import annotations

from typing import Protocol

import torch

from model.moe.balance import count_per_expert
from model.moe.experts import LatentExperts, grouped_backward, grouped_forward
from model.moe.grouped import group_offsets, grouped_mm_experts, resolve_backend
from model.norm import upcast


class Dispatcher(Protocol):
    def __call__(
        self, z_NL: torch.Tensor, expert_idx_NK: torch.Tensor, weight_NK: torch.Tensor, experts: LatentExperts
    ) -> torch.Tensor:
        """u_NL = sum_k weight[n, k] * E_{idx[n, k]}(z[n]); expert ids are global; returns z's dtype."""
        ...


def sort_by_expert(expert_idx_NK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order_M, inverse_M, counts_E) for the M = N*K flattened (token, slot) pairs.

    order: stable argsort by expert id (pairs of one expert stay in token order); inverse: position of each
    (token, slot) pair in the sorted list; counts: pairs per expert (on the device, no host sync).
    """
    flat_M = expert_idx_NK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    inverse_M = torch.empty_like(order_M)
    inverse_M[order_M] = torch.arange(order_M.numel(), device=order_M.device)
    return order_M, inverse_M, count_per_expert(flat_M, num_experts)


def combine_slots(y_NKL: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """sum_k weight[:, k] * y[:, k] in >= fp32, accumulated in slot order 0..K-1 (fixed, so bitwise reproducible)."""
    w_NK = upcast(weight_NK)
    u_NL = upcast(y_NKL[:, 0]).to(w_NK.dtype) * w_NK[:, :1]
    for k in range(1, y_NKL.shape[1]):
        u_NL.addcmul_(upcast(y_NKL[:, k]).to(w_NK.dtype), w_NK[:, k : k + 1])
    return u_NL


def combine_sorted(y_ML: torch.Tensor, inverse_KN: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """combine_slots(y_ML[inverse].view(N, K, l), weight), bit for bit, one slot's rows gathered at a time into
    one reused buffer (never the [N, K, l] copy). inverse_KN[k, n]: row of y_ML holding token n's slot-k result."""
    w_NK = upcast(weight_NK)
    row_NL = y_ML.new_empty(inverse_KN.shape[1], y_ML.shape[1])
    u_NL = upcast(torch.index_select(y_ML, 0, inverse_KN[0], out=row_NL)).to(w_NK.dtype) * w_NK[:, :1]
    for k in range(1, inverse_KN.shape[0]):
        u_NL.addcmul_(upcast(torch.index_select(y_ML, 0, inverse_KN[k], out=row_NL)).to(w_NK.dtype), w_NK[:, k : k + 1])
    return u_NL


def sum_sorted(g_ML: torch.Tensor, inverse_KN: torch.Tensor) -> torch.Tensor:
    """sum_k g_ML[inverse_KN[k]] in slot order 0..K-1 (the slot sum of an [N, K, l] gather, bit for bit)."""
    g_NL = g_ML.index_select(0, inverse_KN[0])
    if inverse_KN.shape[0] > 1:
        row_NL = torch.empty_like(g_NL)
        for k in range(1, inverse_KN.shape[0]):
            g_NL.add_(torch.index_select(g_ML, 0, inverse_KN[k], out=row_NL))
    return g_NL


class _LocalMoE(torch.autograd.Function):
    """gather -> grouped experts -> combine as one node; saves z, weight, the permutation and (keep mode) the GLU
    inputs. Rows are gathered per expert inside the expert loop (no [M, l] copies of z or g)."""

    @staticmethod
    def forward(
        ctx,
        z_NL,
        weight_NK,
        w1,
        w3,
        w2,
        expert_idx_NK,
        beta1: float,
        beta2: float,  # type: ignore[override]
        recompute: bool = True,
    ):
        N, K = expert_idx_NK.shape
        order_M, inverse_M, counts_E = sort_by_expert(expert_idx_NK, w1.shape[0])
        counts = counts_E.tolist()
        token_M = order_M // K  # source token of each grouped row
        inverse_KN = inverse_M.view(N, K).t().contiguous()
        keep_h: list[torch.Tensor] | None = None if recompute else []  # per block [2, rows, Im]: W1 z, W3 z
        y_ML = grouped_forward(z_NL, counts, w1, w3, w2, beta1, beta2, keep_h=keep_h, rows_M=token_M)
        u_NL = combine_sorted(y_ML, inverse_KN, weight_NK)
        ctx.save_for_backward(z_NL, weight_NK, w1, w3, w2, order_M, inverse_KN, *(keep_h or ()))
        ctx.recompute = recompute
        ctx.counts, ctx.betas = counts, (beta1, beta2)
        return u_NL.to(z_NL.dtype)

    @staticmethod
    def backward(ctx, g_NL):  # type: ignore[override]
        z_NL, weight_NK, w1, w3, w2, order_M, inverse_KN, *kept = ctx.saved_tensors
        N, K = weight_NK.shape
        p_M = upcast(weight_NK).reshape(-1).index_select(0, order_M)
        g_zM, g_w1, g_w3, g_w2, g_pM = grouped_backward(
            z_NL,
            g_NL.contiguous(),
            ctx.counts,
            w1,
            w3,
            w2,
            *ctx.betas,
            row_weight_M=p_M,
            keep_h=None if ctx.recompute else kept,
            rows_M=order_M // K,
        )
        g_z = sum_sorted(g_zM, inverse_KN)
        g_w = g_pM.index_select(0, inverse_KN.t().reshape(-1)).view(N, K).to(weight_NK.dtype)
        return g_z, g_w, g_w1, g_w3, g_w2, None, None, None, None


def _grouped_mm_moe(z_NL, weight_NK, expert_idx_NK, experts: LatentExperts) -> torch.Tensor:
    """The `grouped_mm` backend (model/moe/grouped.py) with plain autograd: sort, gather, three grouped GEMMs,
    combine in slot order; nothing read on the host."""
    N, K = expert_idx_NK.shape
    order_M, inverse_M, counts_E = sort_by_expert(expert_idx_NK, experts.num_local)
    z_ML = z_NL.index_select(0, order_M // K)
    y_ML = grouped_mm_experts(z_ML, group_offsets(counts_E), *experts.weights(), experts.beta1, experts.beta2)
    return combine_slots(y_ML.index_select(0, inverse_M).view(N, K, -1), weight_NK).to(z_NL.dtype)


class LocalDispatcher:
    """Dropless sort-based dispatch to experts that all live on this rank (expert_offset 0, num_local E).

    recompute=True (default) keeps only z for backward; False also keeps the GLU inputs (faster backward).
    backend: `loop` (the fused node below, per-expert GEMMs over host counts), `grouped_mm` (one grouped GEMM
    per weight, no host sync; plain autograd keeps its activations), `auto` (model/moe/grouped.py).
    """

    def __init__(self, recompute: bool = True, backend: str = "auto") -> None:
        self.recompute = recompute
        resolve_backend(backend, torch.device("cpu"))  # validates the name
        self.backend = backend

    def __call__(
        self, z_NL: torch.Tensor, expert_idx_NK: torch.Tensor, weight_NK: torch.Tensor, experts: LatentExperts
    ) -> torch.Tensor:
        if experts.num_local != experts.num_experts:
            raise ValueError(
                f"LocalDispatcher needs all {experts.num_experts} experts on this rank, the module "
                f"holds {experts.num_local}; plug an expert-parallel dispatcher into LatentMoE"
            )
        if resolve_backend(self.backend, z_NL.device) == "grouped_mm":
            return _grouped_mm_moe(z_NL, weight_NK, expert_idx_NK, experts)
        return _LocalMoE.apply(
            z_NL.contiguous(),
            weight_NK,
            *experts.weights(),
            expert_idx_NK,
            experts.beta1,
            experts.beta2,
            self.recompute,
        )

    def __repr__(self) -> str:
        return f"LocalDispatcher(recompute={self.recompute}, backend={self.backend})"
