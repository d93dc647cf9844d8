"""Routed experts of the latent MoE, stored stacked, run on tokens grouped by expert.

E_i(z) = W2_i[SiTU(W1_i z) * cap(W3_i z)] in the latent width l. Parameters are stacked so one module holds all
local experts: `w1 [E_local, Im, l]`, `w3 [E_local, Im, l]`, `w2 [E_local, l, Im]`.

HF mapping (model/hf.py): `experts.{j}.w1.weight` <-> `experts.w1[j - expert_offset]` (same for w3 and w2; the
HF per-expert weights have exactly these [out, in] shapes), for the global expert ids
j in [expert_offset, expert_offset + num_local).

The expert maths lives in two pure functions, `grouped_forward` and `grouped_backward` (hand-written gradient
that recomputes the activations from the inputs), shared by `forward_grouped` here and by the fused local
dispatcher (model/moe/dispatch.py), so an expert-parallel dispatcher that calls `forward_grouped` on the
tokens it received computes the same numbers.
"""
from __future__ import annotations

import torch
from torch import nn

from model.config import K3Config
from model.ffn import cap, situ
from model.norm import upcast


def _w13(w1: torch.Tensor, w3: torch.Tensor, e: int) -> torch.Tensor:
    """[2*Im, l]: expert e's gate and up weights stacked, so both projections are one GEMM."""
    return torch.cat([w1[e], w3[e]], dim=0)


def _glu(h13: torch.Tensor, beta1: float, beta2: float, grad: bool = False):
    """From h13 = [W1 z, W3 z] ([m, 2*Im]): a = SiTU(h1)*cap(h3) in >= fp32, and with grad=True also
    (da/dh1, da/dh3). Three sigmoid passes in all (tanh(x) = 2*sigmoid(2x) - 1), mostly in place."""
    Im = h13.shape[1] // 2
    h = upcast(h13)
    h1, h3 = h[:, :Im], h[:, Im:]
    sg1 = torch.sigmoid(h1)
    t1 = torch.sigmoid(h1 * (2.0 / beta1)).mul_(2.0).sub_(1.0)  # tanh(h1/b1)
    t3 = torch.sigmoid(h3 * (2.0 / beta2)).mul_(2.0).sub_(1.0)  # tanh(h3/b2)
    s1 = (t1 * sg1).mul_(beta1)  # SiTU(h1)
    a = s1 * t3 * beta2  # SiTU(h1) * cap(h3)
    if not grad:
        return a
    # dSiTU/dh1 = sg1*((1 - t1^2) + b1*t1*(1 - sg1));  dcap/dh3 = 1 - t3^2
    d1 = (1.0 - sg1).mul_(t1).mul_(beta1).add_(1.0).sub_(t1 * t1).mul_(sg1).mul_(t3).mul_(beta2)
    d3 = (1.0 - t3 * t3).mul_(s1)
    return a, d1, d3


def grouped_forward(z_ML: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    beta1: float, beta2: float, h13_out: torch.Tensor | None = None) -> torch.Tensor:
    """y_ML for rows grouped contiguously by expert (counts[e] rows for local expert e): two GEMMs per expert.

    `h13_out` ([M, 2*Im], optional) receives the GLU inputs [W1 z, W3 z] for a backward that keeps them.
    """
    y_ML = torch.empty(z_ML.shape[0], w2.shape[1], dtype=z_ML.dtype, device=z_ML.device)
    start = 0
    for e, m in enumerate(counts):
        if m == 0:
            continue
        z = z_ML[start:start + m]  # [m, l]
        if h13_out is None:
            h13 = z @ _w13(w1, w3, e).t()  # [m, 2Im]
        else:
            h13 = torch.mm(z, _w13(w1, w3, e).t(), out=h13_out[start:start + m])
        a = _glu(h13, beta1, beta2).to(z.dtype)  # [m, Im]
        torch.mm(a, w2[e].t(), out=y_ML[start:start + m])
        start += m
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
    h13_M: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of sum_m <g_m, p_m * y_m> for y = grouped_forward(z): (g_z, g_w1, g_w3, g_w2, g_p).

    `row_weight_M` (p, >= fp32) is the per-row mixing weight, or None for p = 1 (then g_p is None). The GLU
    activations are recomputed from z (five GEMMs per expert) unless the forward kept h13 = [W1 z, W3 z]
    (`h13_M`, four GEMMs); <g, y> for g_p is taken as <g W2, a>, which avoids recomputing y.
    """
    g_z = torch.empty_like(z_ML)
    g_w1, g_w3, g_w2 = torch.empty_like(w1), torch.empty_like(w3), torch.empty_like(w2)
    g_p = None if row_weight_M is None else torch.empty_like(row_weight_M)
    Im = w1.shape[1]
    w2s, gw1s, gw3s, gw2s = w2.unbind(0), g_w1.unbind(0), g_w3.unbind(0), g_w2.unbind(0)
    start = 0
    for e, m in enumerate(counts):
        if m == 0:  # an expert without tokens gets a zero gradient
            gw1s[e].zero_(), gw3s[e].zero_(), gw2s[e].zero_()
            continue
        sl = slice(start, start + m)
        z, g = z_ML[sl], g_ML[sl]  # [m, l]
        w13 = _w13(w1, w3, e)  # [2Im, l]
        h13 = z @ w13.t() if h13_M is None else h13_M[sl]  # [m, 2Im], recomputed or kept
        a, d1, d3 = _glu(h13, beta1, beta2, grad=True)  # >= fp32
        ga = upcast_mm(g, w2s[e])  # [m, Im] = g W2
        if row_weight_M is not None:
            p = row_weight_M[sl].unsqueeze(-1)  # [m, 1]
            g_p[sl] = (ga * a).sum(-1)
            ga.mul_(p)
            g = (g * p).to(z.dtype)
        torch.mm(g.t(), a.to(z.dtype), out=gw2s[e])  # [l, Im]
        g_h13 = torch.cat([d1.mul_(ga), d3.mul_(ga)], dim=1).to(z.dtype)  # [m, 2Im]
        torch.mm(g_h13[:, :Im].t(), z, out=gw1s[e])  # [Im, l]
        torch.mm(g_h13[:, Im:].t(), z, out=gw3s[e])
        torch.mm(g_h13, w13, out=g_z[sl])
        start += m
    return g_z, g_w1, g_w3, g_w2, g_p


def upcast_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b returned in >= fp32 (the matmul itself runs in the inputs' dtype)."""
    out = a @ b
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


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


class LatentExperts(nn.Module):
    """The routed experts held by this rank: global ids [expert_offset, expert_offset + num_local)."""

    def __init__(self, config: K3Config, num_local: int | None = None, expert_offset: int = 0) -> None:
        super().__init__()
        E = config.num_experts
        self.num_experts = E
        self.num_local = E if num_local is None else int(num_local)
        self.expert_offset = int(expert_offset)
        if not (0 <= self.expert_offset and self.expert_offset + self.num_local <= E):
            raise ValueError(f"local experts [{expert_offset}, {expert_offset}+{self.num_local}) exceed "
                             f"num_experts={E}; fix num_local/expert_offset")
        Im, l = config.moe_intermediate_size, config.routed_expert_hidden_size
        self.beta1 = float(config.activation_situ_beta)
        self.beta2 = float(config.activation_situ_linear_beta)
        self.init_std = config.initializer_range
        self.w1 = nn.Parameter(torch.empty(self.num_local, Im, l))
        self.w3 = nn.Parameter(torch.empty(self.num_local, Im, l))
        self.w2 = nn.Parameter(torch.empty(self.num_local, l, Im))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, mean=0.0, std=self.init_std)

    def forward_grouped(self, z_ML: torch.Tensor, counts_E: torch.Tensor | list[int]) -> torch.Tensor:
        """Run local expert e on the counts_E[e] consecutive rows of z_ML: [M, l] -> [M, l] (M = sum counts)."""
        counts = counts_E.tolist() if isinstance(counts_E, torch.Tensor) else list(counts_E)
        if len(counts) != self.num_local or sum(counts) != z_ML.shape[0]:
            raise ValueError(f"counts_E must have {self.num_local} entries summing to {z_ML.shape[0]} rows; "
                             f"got {len(counts)} summing to {sum(counts)}")
        return _GroupedExperts.apply(z_ML.contiguous(), self.w1, self.w3, self.w2, counts, self.beta1, self.beta2)

    def expert(self, j: int, z_NL: torch.Tensor) -> torch.Tensor:
        """Reference: local expert j on arbitrary rows with plain autograd (tests, debugging)."""
        a = (situ(z_NL @ self.w1[j].t(), self.beta1) * cap(z_NL @ self.w3[j].t(), self.beta2)).to(z_NL.dtype)
        return a @ self.w2[j].t()

    def extra_repr(self) -> str:
        return (f"num_local={self.num_local}, expert_offset={self.expert_offset}, "
                f"w1={tuple(self.w1.shape)}, w2={tuple(self.w2.shape)}")
