"""RMSNorm and the fp32-compute convention shared by every module.

docs/model.md §10: norms, gates, routers and recurrences compute "in fp32". Tests also run whole models in float64
against an fp64 oracle, so "fp32" here means *at least* fp32: `upcast` never narrows float64.
"""

from __future__ import annotations

import torch
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Return `x` in fp32, or unchanged if it is already fp32/fp64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`w * x / sqrt(mean(x^2) + eps)` over the last dim, computed in (at least) fp32, returned in x's dtype."""
    x32 = upcast(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * upcast(weight)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learnable scale initialised to 1."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
