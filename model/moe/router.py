"""The K3 router: fp32 sigmoid scores, bias-corrected top-k selection, weights from the unbiased scores.

`e_score_correction_bias` (b) only decides *which* experts a token goes to (`topk(s + b)`); the mixing weights
use the raw scores `p = s[I] / sum s[I] * routed_scaling_factor`, so balancing never distorts what a token
computes and the router is trained only through p. The bias is a persistent fp32 buffer owned by the balancer
(model/moe/balance.py), never by the optimizer.

Ties are broken deterministically towards the lower expert id (a stable descending sort), so routing is a pure
function of the scores on every device and every expert-parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.config import K3Config
from model.norm import upcast


@dataclass
class Routing:
    """One routing decision for N tokens."""

    scores_NE: torch.Tensor  # [N, E] sigmoid scores, >= fp32, differentiable w.r.t. the router weight
    expert_idx_NK: torch.Tensor  # [N, K] int64 global expert ids, in selection order (best first)
    weight_NK: torch.Tensor  # [N, K] >= fp32 mixing weights p (differentiable)


def topk_desc(x_NE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim with ties broken towards the lower index (stable sort): (values, indices)."""
    vals, idx = torch.sort(x_NE, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def group_mask(biased_NE: torch.Tensor, num_groups: int, topk_group: int) -> torch.Tensor:
    """[N, E] bool: experts inside the `topk_group` best groups, group score = sum of its top-2 biased scores.

    DeepSeek-V3 node-limited routing; groups are contiguous blocks of E / num_groups expert ids.
    """
    N, E = biased_NE.shape
    per_group = E // num_groups
    grouped_NGP = biased_NE.view(N, num_groups, per_group)
    top2 = min(2, per_group)
    group_score_NG = torch.sort(grouped_NGP, dim=-1, descending=True, stable=True)[0][..., :top2].sum(-1)
    _, keep_NG = topk_desc(group_score_NG, topk_group)
    mask_NG = torch.zeros(N, num_groups, dtype=torch.bool, device=biased_NE.device)
    mask_NG.scatter_(1, keep_NG, True)
    return mask_NG.repeat_interleave(per_group, dim=1)


def select_experts(
    scores_NE: torch.Tensor,
    bias_E: torch.Tensor | None,
    k: int,
    num_groups: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure routing maths: (expert_idx_NK, weight_NK) from scores s in (0, 1).

    I = topk(s + b) (within the kept groups when num_groups > 1); p = s[I] (/ sum s[I] when renormalize) * scaling.
    """
    with torch.no_grad():
        biased_NE = scores_NE.detach() if bias_E is None else scores_NE.detach() + bias_E.to(scores_NE.dtype)
        if num_groups > 1:
            biased_NE = biased_NE.masked_fill(~group_mask(biased_NE, num_groups, topk_group), float("-inf"))
        _, idx_NK = topk_desc(biased_NE, k)
    weight_NK = scores_NE.gather(1, idx_NK)  # unbiased scores, differentiable
    if renormalize:
        weight_NK = weight_NK / (weight_NK.sum(-1, keepdim=True) + 1e-20)
    return idx_NK, weight_NK * scaling


class Router(nn.Module):
    """HF `gate`: `weight [E, d]` (router sees the full-width x) and the fp32 `e_score_correction_bias [E]`."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        E, d = config.num_experts, config.hidden_size
        self.num_experts = E
        self.top_k = config.num_experts_per_token
        self.num_groups = config.num_expert_group if config.use_grouped_topk else 1
        self.topk_group = config.topk_group if self.num_groups > 1 else 1
        self.renormalize = config.moe_renormalize
        self.scaling = float(config.routed_scaling_factor)
        self.init_std = config.initializer_range
        self.weight = nn.Parameter(torch.empty(E, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        with torch.no_grad():
            self.e_score_correction_bias.zero_()

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """Keep the bias in (at least) fp32 under `.to(bfloat16)` / `.half()` (docs/model.md §12: an fp32 tensor)."""
        orig = self.e_score_correction_bias
        out = super()._apply(fn, recurse)
        b = self.e_score_correction_bias
        if b.dtype in (torch.float16, torch.bfloat16):
            self.e_score_correction_bias = orig.to(device=b.device, dtype=torch.float32)
        return out

    def scores(self, x_ND: torch.Tensor) -> torch.Tensor:
        """sigmoid(W_r x) in >= fp32: [N, d] -> [N, E]."""
        x32 = upcast(x_ND)
        return torch.sigmoid(F.linear(x32, self.weight.to(x32.dtype)))

    def forward(self, x_ND: torch.Tensor) -> Routing:
        s_NE = self.scores(x_ND)
        idx_NK, w_NK = select_experts(
            s_NE,
            self.e_score_correction_bias,
            self.top_k,
            self.num_groups,
            self.topk_group,
            self.renormalize,
            self.scaling,
        )
        return Routing(s_NE, idx_NK, w_NK)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, groups={self.num_groups}/{self.topk_group}"
