"""SiTU-GLU feed-forward (K3 report Eq.12): the dense FFN, the fused shared experts and (as pure functions) the
routed experts.

SiTU(a) = b1*tanh(a/b1)*sigmoid(a) and cap(u) = b2*tanh(u/b2) are both bounded (|SiTU| < b1, |cap| < b2), so every
GLU element is below b1*b2 in magnitude whatever the weights do: no activation outliers. The activation maths runs
in at least fp32 (`upcast`) and is cast back to the input dtype for the down projection.

tanh is evaluated as 2*sigmoid(2x) - 1: the same function (absolute error ~1e-7 in fp32, ~1e-16 in fp64), but
ATen's CPU sigmoid is ~4x faster than its tanh, and the MoE experts evaluate it on every routed row.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.config import K3Config
from model.norm import upcast


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) = 2*sigmoid(2x) - 1 (exactly bounded by 1; faster than torch.tanh on CPU)."""
    if x.requires_grad and torch.is_grad_enabled():
        return 2.0 * torch.sigmoid(2.0 * x) - 1.0
    return torch.sigmoid(2.0 * x).mul_(2.0).sub_(1.0)  # no autograd graph: in place


def situ(a: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU(a) = beta*tanh(a/beta)*sigmoid(a), in >= fp32; |SiTU(a)| < beta, ~ a*sigmoid(a) (SiLU) for |a| << beta."""
    a32 = upcast(a)
    return beta * tanh(a32 / beta) * torch.sigmoid(a32)


def cap(u: torch.Tensor, beta: float) -> torch.Tensor:
    """cap(u) = beta*tanh(u/beta), in >= fp32: the identity for |u| << beta, bounded by beta."""
    return beta * tanh(upcast(u) / beta)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """SiTU(gate) * cap(up), computed in >= fp32 and returned in gate's dtype; |element| < beta1*beta2."""
    return (situ(gate, beta1) * cap(up, beta2)).to(gate.dtype)


class SiTUGLU(nn.Module):
    """down[SiTU(gate x) * cap(up x)] with HF names `gate_proj`, `up_proj`, `down_proj` (no biases).

    Width `inter` is `intermediate_size` for the dense FFN and `num_shared_experts * moe_intermediate_size` for
    the shared experts (the S shared experts are one fused GLU).

    `tile_rows` > 0 (training, `set_ffn_tiling`): TiledMLP-style recompute over sequence tiles. Each tile of
    `tile_rows` tokens runs under its own non-reentrant checkpoint, so backward keeps only the input tokens and
    recomputes one tile's [tile, inter] gate/up/GLU activations at a time, where the untiled FFN keeps 3 x [T, inter]
    of them from forward to backward (at K3's inter = 18,432 and 32k tokens per GPU: 3.6 GB per layer in bf16). The
    tiles call the projections as modules, so ZeRO-3 gathers their weights for the recompute as for activation
    checkpointing. Every row is computed by the same ops as untiled: the values agree to rounding.
    """

    tile_rows: int = 0

    def __init__(self, dim: int, inter: int, config: K3Config) -> None:
        super().__init__()
        self.dim, self.inter = dim, inter
        self.beta1 = float(config.activation_situ_beta)
        self.beta2 = float(config.activation_situ_linear_beta)
        self.init_std = config.initializer_range
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=self.init_std)

    def _glu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta1, self.beta2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        if self.tile_rows <= 0 or not (self.training and torch.is_grad_enabled()):
            return self._glu(x)
        x_ND = x.reshape(-1, x.shape[-1])
        tiles = [checkpoint(self._glu, t, use_reentrant=False) for t in x_ND.split(self.tile_rows)]
        return torch.cat(tiles).view(*x.shape[:-1], self.dim)
