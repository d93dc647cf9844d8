"""Tiled logits + cross-entropy: the LM loss of a long sequence without ever materialising its [T, V] logits.

At 32k tokens per GPU and K3's vocab of 163,840 the logits and their gradient are 24 GB (docs/planning.md). The
tiled loss computes `hidden @ lm_head.weight^T` for `tile_rows` tokens at a time, keeps only each token's
logsumexp, and recomputes the tile's logits in backward, where it accumulates both gradients tile by tile. What
lives besides the inputs: one [tile, V] chunk (plus its softmax) and the weight gradient.

Why not DeepSpeed's `TiledFusedLogitsLoss` (runtime/sequence_parallel/ulysses_sp.py, 0.19.8): it runs the backward
inside the forward with a faked incoming gradient of 1 (or 1/shards) and rescales only the hidden-state gradient
by the real one in its own backward, so the lm_head weight gradient never sees the trainer's loss scale (each
micro-batch's CE is multiplied by its token share, training/step.py); it also reduces that gradient during the
forward. This function is an ordinary autograd node and lives in `model/` (no DeepSpeed): under ZeRO-3 `LMHead`
is a module, so DeepSpeed's hooks gather `weight` around its forward and again before its backward (the node
saves the parameter itself, as DeepSpeed's memory-efficient linear does, runtime/zero/linear.py).
"""

from __future__ import annotations

import torch
from torch import nn

from model.norm import upcast

IGNORE_INDEX = -100


class TiledLinearCrossEntropy(torch.autograd.Function):
    """Sum over rows with target != -100 of CE(hidden @ weight^T, target), `rows` tokens of logits at a time.

    Each tile's logits are computed in the input dtype (as `lm_head` would) and upcast to >= fp32 for the
    logsumexp, exactly as the untiled loss treats its logits. The weight gradient accumulates tile by tile in the
    weight's own dtype, in place (`addmm_`: no [V, D] temporary; in bf16 one rounding per tile, where one GEMM over
    all tokens rounds once): an fp32 accumulator would cost 4 B x V x D (4.7 GB at K3's vocab)."""

    @staticmethod
    def forward(
        ctx, hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor, rows: int
    ) -> torch.Tensor:
        N = hidden_ND.shape[0]
        acc = upcast(hidden_ND[:0]).dtype
        lse_N = torch.empty(N, dtype=acc, device=hidden_ND.device)
        total = torch.zeros((), dtype=acc, device=hidden_ND.device)
        for s in range(0, N, rows):
            l_CV = upcast(hidden_ND[s : s + rows] @ weight_VD.t())
            t_C = targets_N[s : s + rows]
            lse_C = torch.logsumexp(l_CV, dim=-1)
            tgt_C = l_CV.gather(-1, t_C.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            total = total + torch.where(t_C != IGNORE_INDEX, lse_C - tgt_C, 0.0).sum()
            lse_N[s : s + rows] = lse_C
            del l_CV
        ctx.save_for_backward(hidden_ND, weight_VD, targets_N, lse_N)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden_ND, weight_VD, targets_N, lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden_ND) if need_h else None
        grad_w = torch.zeros_like(weight_VD) if need_w else None
        rows = ctx.rows
        for s in range(0, hidden_ND.shape[0], rows):
            h_CD, t_C = hidden_ND[s : s + rows], targets_N[s : s + rows]
            # softmax of the recomputed tile, minus one-hot at the target, times the incoming gradient
            p_CV = (upcast(h_CD @ weight_VD.t()) - lse_N[s : s + rows].unsqueeze(-1)).exp_()
            valid_C = (t_C != IGNORE_INDEX).to(p_CV.dtype)
            p_CV.scatter_add_(-1, t_C.clamp_min(0).unsqueeze(-1), -valid_C.unsqueeze(-1))
            p_CV.mul_((valid_C * grad_out).unsqueeze(-1))
            g_CV = p_CV.to(hidden_ND.dtype)  # the logits gradient as the untiled path hands it to lm_head
            if grad_h is not None:
                grad_h[s : s + rows] = g_CV @ weight_VD
            if grad_w is not None:
                grad_w.addmm_(g_CV.t(), h_CD)
            del p_CV, g_CV
        return grad_h, grad_w, None, None


class LMHead(nn.Linear):
    """The untied output projection (`lm_head.weight [V, D]`, no bias). `forward(hidden)` gives logits;
    `forward(hidden, targets_N)` with `tile_rows` > 0 gives the summed CE over counted targets through
    `TiledLinearCrossEntropy` instead, and no logits (a module call, so ZeRO-3 gathers `weight` for both)."""

    tile_rows: int = 0  # tokens of logits per tile of the fused loss; 0: the loss takes full logits

    def forward(self, hidden: torch.Tensor, targets_N: torch.Tensor | None = None) -> torch.Tensor:
        if targets_N is None:
            return super().forward(hidden)
        if self.tile_rows <= 0:
            raise ValueError("LMHead got targets without tile_rows > 0; call set_loss_tiling(tokens) first")
        h_ND = hidden.reshape(-1, hidden.shape[-1])
        return TiledLinearCrossEntropy.apply(h_ND, self.weight, targets_N.reshape(-1), int(self.tile_rows))
