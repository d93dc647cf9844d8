"""Pointwise pieces of the KDA mixer shared by the layer and its tiled core: the L2 norm and the causal short conv."""

from __future__ import annotations

import torch

from model.norm import upcast

L2_EPS = 1e-6  # q, k <- x / sqrt(||x||^2 + 1e-6) per head (fla's l2norm)


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim, in (at least) fp32."""
    x32 = upcast(x)
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


def causal_depthwise_conv(
    u_BTP: torch.Tensor,
    weight_PW: torch.Tensor,
    prefix_BWP: torch.Tensor | None = None,
    segment_start_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """y_t[c] = sum_j w[c, j] u_{t-W+1+j}[c], zeros (or `prefix`, the W-1 inputs before t=0) before the start.

    `segment_start_T` (packed documents): the first position of each token's document; taps reaching before it
    read zeros, so the conv never sees the previous document. Computed in (at least) fp32.
    """
    B, T, P = u_BTP.shape
    W = weight_PW.shape[-1]
    u = upcast(u_BTP)
    w = upcast(weight_PW).to(u.dtype)
    if prefix_BWP is None:
        prefix_BWP = u.new_zeros(B, W - 1, P)
    full = torch.cat([prefix_BWP.to(u.dtype), u], dim=1)  # [B, W-1+T, P]
    y = u * w[:, W - 1]
    pos_T = torch.arange(T, device=u.device)
    for s in range(1, W):  # tap W-1-s reads the input s steps back
        tap_BTP = full[:, W - 1 - s : W - 1 - s + T]
        if segment_start_T is not None:
            tap_BTP = tap_BTP * (pos_T - s >= segment_start_T).to(u.dtype)[None, :, None]
        y = y + tap_BTP * w[:, W - 1 - s]
    return y
