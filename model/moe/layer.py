"""Stable LatentMoE (K3 report §2.3, docs/model.md §5): full-width router, routed experts in a latent width, normed sum.

    s = sigmoid(W_r x);  I = topk(s + b);  p = s[I] / sum s[I]
    z = W_down x (d -> l, once per token);  u = sum_k p_k E_{I_k}(z)
    y = W_up RMSNorm(u) + Shared(x)

The RMSNorm on the aggregated latent makes y independent of u's scale, which varies with how many and which
experts were selected. `dispatcher` is the swappable seam (model/moe/dispatch.py): the local dropless one by
default, an expert-parallel all-to-all one under training. In training mode the forward returns the routing
statistics (`RouterStats.balance`, from `balancer.observe`); the trainer reduces a step's statistics and calls
`balancer.update(global_stats)` once per optimizer step (model/moe/balance.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.config import K3Config
from model.ffn import SiTUGLU
from model.moe.balance import Balancer, BalanceStats, count_per_expert
from model.moe.dispatch import Dispatcher, LocalDispatcher
from model.moe.experts import LatentExperts
from model.moe.router import Router
from model.norm import RMSNorm


@dataclass
class RouterStats:
    """Routing statistics of one MoE forward: for balancing, load metrics (training/metrics) and the aux loss.

    balance: this forward's BalanceStats (tokens per global expert id, QB margins/histogram), local tokens only
        (not reduced across ranks); `tokens_per_expert` is its counts_E ([E] int64, sums to N*K).
    aux_loss: differentiable scalar (balance == 'aux', training mode), else None; add it to the LM loss.
    num_tokens: N, the tokens routed in this forward.
    layer_idx: the decoder layer this MoE belongs to.
    """

    balance: BalanceStats
    aux_loss: torch.Tensor | None
    num_tokens: int
    layer_idx: int

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.balance.counts_E


class LatentMoE(nn.Module):
    """HF prefix `model.layers.{i}.block_sparse_moe.`: gate, experts, shared_experts, routed_expert_{down,up}_proj,
    routed_expert_norm."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        d, l = config.hidden_size, config.routed_expert_hidden_size
        self.layer_idx = layer_idx
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        self.init_std = config.initializer_range
        self.gate = Router(config)
        self.experts = LatentExperts(config)
        self.shared_experts = (
            SiTUGLU(d, config.num_shared_experts * config.moe_intermediate_size, config)
            if config.num_shared_experts > 0
            else None
        )
        self.routed_expert_down_proj = nn.Linear(d, l, bias=False)
        self.routed_expert_up_proj = nn.Linear(l, d, bias=False)
        self.routed_expert_norm = RMSNorm(l, config.rms_norm_eps) if config.latent_moe_use_norm else None
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.balancer = Balancer(config, self.gate)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.routed_expert_down_proj, self.routed_expert_up_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=self.init_std)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        route = self.gate(x_ND)
        aux = None
        if self.training:
            balance = self.balancer.observe(route.scores_NE, route.expert_idx_NK)
            aux = self.balancer.aux_loss(route.scores_NE, route.expert_idx_NK, B)
        else:  # eval/decode: only the load counts
            balance = BalanceStats(count_per_expert(route.expert_idx_NK, self.num_experts))
        z_NL = self.routed_expert_down_proj(x_ND)
        with self.experts.recompute_merged():  # LoRA: merged expert weights re-made in backward, not kept
            u_NL = self.dispatcher(z_NL, route.expert_idx_NK, route.weight_NK, self.experts)
        if self.routed_expert_norm is not None:
            u_NL = self.routed_expert_norm(u_NL)
        y_ND = self.routed_expert_up_proj(u_NL)
        if self.shared_experts is not None:
            y_ND = y_ND + self.shared_experts(x_ND)
        stats = RouterStats(balance=balance, aux_loss=aux, num_tokens=B * T, layer_idx=self.layer_idx)
        return y_ND.view(B, T, D), stats
