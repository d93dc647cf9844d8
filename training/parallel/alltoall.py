"""Dropless all-to-all token dispatch for expert parallelism (the EP implementation of model.moe's dispatch seam).

Why: with E experts spread over the P ranks of an expert-parallel group (rank p owns the contiguous global ids
[p*E/P, (p+1)*E/P)), each token's k latent vectors must travel to the ranks owning its experts and come back.
K3's LatentMoE projects d -> l before routing, so we ship z in the latent width l (not d): that is the point.

Protocol per forward (one MoE layer, one rank):
  1. sort the N*k (token, expert) slots by global expert id (stable -> deterministic), count per expert [E];
  2. all_to_all the counts (E/P per peer) so every rank knows how many rows it receives per (source, local expert);
  3. all_to_all the sorted latent rows with variable split sizes (no capacity, nothing dropped, no RNG);
  4. regroup the received rows by local expert (stable: source rank order inside an expert), run each local expert
     once on its contiguous slice (model.moe.experts.grouped_forward), undo the regrouping;
  5. all_to_all the outputs back (reversed splits) and combine with the routing weights exactly as the local
     dispatcher does (same sorted order, `combine_slots`), so results match the single-rank path.
The whole exchange is one autograd node whose backward runs the same all_to_alls in reverse and the same
hand-written expert backward as the local path: outputs and gradients equal the single-rank path bitwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.moe.dispatch import combine_slots, sort_by_expert
from model.moe.experts import grouped_backward, grouped_forward
from model.moe.grouped import group_offsets, grouped_mm_experts, resolve_backend
from model.norm import upcast


def exchange_counts(counts_E: torch.Tensor, group=None) -> torch.Tensor:
    """[E] rows this rank sends per global expert -> [P, E/P] rows it receives per (source rank, local expert)."""
    P = dist.get_world_size(group)
    recv_E = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_E, counts_E.contiguous(), group=group)  # equal splits: E/P ids per peer
    return recv_E.view(P, -1)


class _ExpertParallelMoE(torch.autograd.Function):
    """gather -> all_to_all -> grouped local experts -> all_to_all back -> combine, as one autograd node.

    Mirrors the local dispatcher's fused node (model/moe/dispatch.py `_LocalMoE`) step for step: the expert rank
    keeps only the received latent rows and their routing weights, and in backward calls the same
    `grouped_backward` on the same rows (in the same order, when ranks hold consecutive shares of the batch), so
    outputs *and* gradients equal the single-rank path bitwise.
    """

    @staticmethod
    def forward(ctx, z_NL, weight_NK, w1, w3, w2, expert_idx_NK, disp: AllToAllDispatcher, beta1: float, beta2: float):  # type: ignore[override]
        P, El, group = disp.ep_size, disp.num_local, disp.group
        N, K = expert_idx_NK.shape
        order_M, inverse_M, counts_E = sort_by_expert(expert_idx_NK, disp.num_experts)
        recv_PE = exchange_counts(counts_E, group)  # [P, El] rows received per (source rank, local expert)
        send = counts_E.view(P, El).sum(1).tolist()
        recv = recv_PE.sum(1).tolist()
        # regroup received rows by local expert (stable: source-rank order inside an expert)
        local_id = torch.repeat_interleave(  # output_size: the row count is known on the host (no sync)
            torch.arange(El, device=z_NL.device).repeat(P), recv_PE.reshape(-1), output_size=sum(recv)
        )
        perm_R = torch.argsort(local_id, stable=True)
        grouped = resolve_backend(disp.backend, z_NL.device) == "grouped_mm"
        # grouped_mm: the local experts' row offsets stay on the device; loop: their counts on the host
        counts = group_offsets(recv_PE.sum(0)) if grouped else recv_PE.sum(0).tolist()

        z_ML = z_NL.index_select(0, order_M // K)  # [M, l] latent rows, send order
        p_M = upcast(weight_NK).reshape(-1).index_select(0, order_M)  # [M] routing weight of each row
        z_RL = _a2a(z_ML, recv, send, group).index_select(0, perm_R)  # [R, l] grouped by local expert
        p_R = _a2a(p_M, recv, send, group).index_select(0, perm_R)  # [R]
        if grouped:
            y_RL = grouped_mm_experts(z_RL, counts, w1, w3, w2, beta1, beta2)
        else:
            y_RL = grouped_forward(z_RL, counts, w1, w3, w2, beta1, beta2)
        y_back = _a2a(_unpermute(y_RL, perm_R), send, recv, group)  # [M, l] results in send order
        u_NL = combine_slots(y_back.index_select(0, inverse_M).view(N, K, y_back.shape[-1]), weight_NK)

        ctx.save_for_backward(z_RL, p_R, w1, w3, w2, perm_R, inverse_M, *([counts] if grouped else []))
        ctx.meta = (N, K, send, recv, None if grouped else counts, group, beta1, beta2, weight_NK.dtype)
        disp.bytes_sent = (z_ML.numel() + y_RL.numel()) * z_NL.element_size()
        return u_NL.to(z_NL.dtype)

    @staticmethod
    def backward(ctx, g_NL):  # type: ignore[override]
        z_RL, p_R, w1, w3, w2, perm_R, inverse_M, *offs = ctx.saved_tensors
        N, K, send, recv, counts, group, beta1, beta2, w_dtype = ctx.meta
        order_M = torch.empty_like(inverse_M)
        order_M[inverse_M] = torch.arange(inverse_M.numel(), device=inverse_M.device)
        g_ML = g_NL.contiguous().index_select(0, order_M // K)  # [M, l] output grad of each row, send order
        g_RL = _a2a(g_ML, recv, send, group).index_select(0, perm_R)
        if offs:  # grouped_mm backend: the expert maths' own autograd, recomputed from z (as the loop recomputes)
            g_zR, g_w1, g_w3, g_w2, g_pR = _grouped_backward(z_RL, g_RL, p_R, offs[0], (w1, w3, w2), beta1, beta2)
        else:
            g_zR, g_w1, g_w3, g_w2, g_pR = grouped_backward(
                z_RL, g_RL, counts, w1, w3, w2, beta1, beta2, row_weight_M=p_R
            )
        g_zM = _a2a(_unpermute(g_zR, perm_R), send, recv, group)  # [M, l] back to the token's rank
        g_pM = _a2a(_unpermute(g_pR, perm_R), send, recv, group)  # [M]
        g_z_NKL = g_zM.index_select(0, inverse_M).view(N, K, g_zM.shape[-1])
        g_z = g_z_NKL[:, 0].clone()
        for k in range(1, K):  # slot order 0..K-1, as the local dispatcher
            g_z.add_(g_z_NKL[:, k])
        g_w = g_pM.index_select(0, inverse_M).view(N, K).to(w_dtype)
        return g_z, g_w, g_w1, g_w3, g_w2, None, None, None, None


def _grouped_backward(z_RL, g_RL, p_R, offs_E, weights, beta1: float, beta2: float):
    """(g_z, g_w1, g_w3, g_w2, g_p) of sum_r p_r <g_r, y_r> for y = grouped_mm_experts(z): recompute y with a
    graph and differentiate it (no host read: the offsets stay on the device)."""
    with torch.enable_grad():
        z = z_RL.detach().requires_grad_()
        ws = [w.detach().requires_grad_() for w in weights]
        y_RL = grouped_mm_experts(z, offs_E, *ws, beta1, beta2)
        g_z, *g_ws = torch.autograd.grad(y_RL, [z, *ws], g_RL * p_R.unsqueeze(-1).to(g_RL.dtype), allow_unused=True)
    g_p = (upcast(g_RL) * upcast(y_RL.detach())).sum(-1).to(p_R.dtype)  # <g, y>
    g_ws = [torch.zeros_like(w) if g is None else g for w, g in zip(weights, g_ws)]
    return (torch.zeros_like(z_RL) if g_z is None else g_z), *g_ws, g_p


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Non-differentiable variable-split all_to_all (used inside the fused autograd node)."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _unpermute(x_R: torch.Tensor, perm_R: torch.Tensor) -> torch.Tensor:
    """Inverse of x.index_select(0, perm): row perm[i] of the result is row i of x."""
    out = torch.empty_like(x_R)
    out[perm_R] = x_R
    return out


class AllToAllDispatcher:
    """Expert-parallel `Dispatcher`: u[n] = sum_k weight[n,k] * E_{idx[n,k]}(z[n]) with experts on other ranks.

    `experts` passed at call time holds only this rank's E/P experts (`experts.num_local`, `experts.expert_offset`
    = ep_rank * E/P). Counts and rows are exchanged over `group` (the expert-parallel group). Exposes
    `bytes_sent` (payload bytes of the last forward's latent-row all_to_alls, both directions, this rank).
    """

    def __init__(self, num_experts: int, group=None) -> None:
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by ep_size={self.ep_size}; "
                "choose parallel.ep_size dividing the expert count"
            )
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size
        self.bytes_sent = 0
        self.backend = "auto"  # model.expert_backend (K3ForCausalLM.set_expert_backend): grouped_mm | loop | auto

    def __call__(
        self, z_NL: torch.Tensor, expert_idx_NK: torch.Tensor, weight_NK: torch.Tensor, experts
    ) -> torch.Tensor:
        El = self.num_local
        if experts.num_local != El or experts.expert_offset != self.ep_rank * El:
            raise ValueError(
                f"experts hold ids [{experts.expert_offset}, {experts.expert_offset + experts.num_local})"
                f" but this rank owns [{self.ep_rank * El}, {(self.ep_rank + 1) * El}); "
                "lay the model out with training.parallelize.parallelize"
            )
        return _ExpertParallelMoE.apply(
            z_NL.contiguous(),
            weight_NK,
            *experts.weights(),
            expert_idx_NK,
            self,
            experts.beta1,
            experts.beta2,
        )

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep_size={self.ep_size}, ep_rank={self.ep_rank}, num_local={self.num_local})"
