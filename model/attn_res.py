"""Block Attention Residuals (docs/model.md §6): the residual stream replaced by a softmax mixture over depth.

Every sublayer input is `mix(V, w, g) = sum_n softmax_n(<w * g, V_n / rms(V_n)>) V_n` over a short list of
candidates (the embedding, the completed block sums, and the running partial sum of the current block). The
pseudo-query `w` is input-independent and zero-initialised, so a fresh model starts from the uniform mean of
its candidates. Keys are RMS-normed values with a learnable weight `g`; values stay un-normed; the softmax over
depth runs in (at least) fp32.

The per-layer block bookkeeping lives in `model/k3.py`; the parameters live on each decoder layer under their HF
names (`self_attention_res_proj` = Linear(d, 1) holding the query as weight [1, d], `self_attention_res_norm` =
RMSNorm(d) holding the key weight, same for `mlp_res_*`; final `output_attn_res_*` on `K3Model`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from model.norm import upcast


class _AttnResMix(torch.autograd.Function):
    """The mix with a hand-written backward that saves only the candidates (kept alive as blocks anyway) and three
    [N, ...] fp32 tensors, instead of autograd's fp32 copies of every candidate (N <= 9 per sublayer for K3).

    With p_n = <q, V_n>, r_n = (mean(V_n^2) + eps)^-1/2, l_n = r_n p_n, a = softmax(l), out = sum a_n V_n, q = w * g:
    dl_n = a_n (<G, V_n> - sum_m a_m <G, V_m>),  dV_n = a_n G + dl_n r_n (q - p_n r_n^2 V_n / D),
    dq = sum_n dl_n r_n V_n (summed over positions), dw = dq * g, dg = dq * w.
    """

    @staticmethod
    def forward(ctx, query_w: torch.Tensor, norm_w: torch.Tensor, eps: float, *cands: torch.Tensor) -> torch.Tensor:
        q_D = upcast(query_w) * upcast(norm_w)  # [D]
        p, r = [], []
        for v in cands:
            v32 = upcast(v)  # [..., D]
            r.append(torch.rsqrt(v32.pow(2).mean(-1) + eps))
            p.append(v32 @ q_D)
        p_N, r_N = torch.stack(p), torch.stack(r)  # [N, ...]
        a_N = torch.softmax(p_N * r_N, dim=0)
        out = upcast(cands[0]) * a_N[0].unsqueeze(-1)
        for n in range(1, len(cands)):
            out = out + upcast(cands[n]) * a_N[n].unsqueeze(-1)
        ctx.save_for_backward(query_w, norm_w, p_N, r_N, a_N, *cands)
        return out.to(cands[0].dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        query_w, norm_w, p_N, r_N, a_N, *cands = ctx.saved_tensors
        G = upcast(grad_out)  # [..., D]
        w32, g32 = upcast(query_w), upcast(norm_w)
        q_D = w32 * g32
        D = G.shape[-1]
        s_N = torch.stack([(G * upcast(v)).sum(-1) for v in cands])  # dL/da_n  [N, ...]
        dl_N = a_N * (s_N - (a_N * s_N).sum(0, keepdim=True))  # [N, ...]
        dq_D = torch.zeros_like(q_D)
        grads = []
        for n, v in enumerate(cands):
            v32 = upcast(v)
            c = (dl_N[n] * r_N[n]).unsqueeze(-1)  # [..., 1]
            dq_D = dq_D + (c * v32).reshape(-1, D).sum(0)
            if ctx.needs_input_grad[3 + n]:
                dv = a_N[n].unsqueeze(-1) * G + c * (q_D - (p_N[n] * r_N[n].pow(2) / D).unsqueeze(-1) * v32)
                grads.append(dv.to(v.dtype))
            else:
                grads.append(None)
        dw = (dq_D * g32).to(query_w.dtype) if ctx.needs_input_grad[0] else None
        dg = (dq_D * w32).to(norm_w.dtype) if ctx.needs_input_grad[1] else None
        return (dw, dg, None, *grads)


def attn_res_mix(
    candidates: Sequence[torch.Tensor] | torch.Tensor, query_w: torch.Tensor, norm_w: torch.Tensor, eps: float
) -> torch.Tensor:
    """Softmax-over-depth mixture of `candidates` (list of [..., D], or stacked [N, ..., D]); returns [..., D].

    Computed in >= fp32 and returned in the candidates' dtype. One candidate is returned unchanged.
    """
    cands = list(candidates.unbind(0)) if isinstance(candidates, torch.Tensor) else list(candidates)
    if not cands:
        raise ValueError("attn_res_mix needs at least one candidate; pass the embedding as the first one")
    if len(cands) == 1:
        return cands[0]
    shape = cands[0].shape
    if any(c.shape != shape for c in cands):
        raise ValueError(f"attn_res_mix candidates must share one shape, got {[tuple(c.shape) for c in cands]}")
    return _AttnResMix.apply(query_w, norm_w, float(eps), *cands)


class MixtureSizes(NamedTuple):
    """Candidates of every depth mixture in one forward pass (0 where nothing is mixed)."""

    layers: list[tuple[int, int]]  # per decoder layer: (attention input, FFN input)
    output: int  # the mixture before the final norm


def attn_res_mixture_sizes(num_layers: int, block_size: int | None) -> MixtureSizes:
    """How many candidates each Block AttnRes mixture has (docs/model.md §6), for the FLOPs and memory formulas.

    The bookkeeping of `K3Model.forward` without tensors: layer 0's attention input is the embedding itself (0,
    no mixture); every other sublayer mixes the completed blocks plus the running partial sum; the output mixes
    all blocks plus the last partial sum. `block_size` 0 or None (plain PreNorm stack): every size is 0. K3 (93
    layers, blocks of 12): at most 9.
    """
    if not block_size:
        return MixtureSizes([(0, 0)] * num_layers, 0)
    layers, n_blocks = [], 0  # before layer 0: no completed block, partial = embedding
    for layer in range(num_layers):
        attn = 0 if n_blocks == 0 else n_blocks + 1  # blocks + [partial]
        if layer % block_size == 0:
            n_blocks += 1  # the partial sum becomes a completed block
        layers.append((attn, n_blocks + 1))  # blocks + [partial (now holding this layer's attention output)]
    return MixtureSizes(layers, n_blocks + 1)
