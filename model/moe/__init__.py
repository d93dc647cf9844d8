"""Stable LatentMoE: router, latent experts, dispatch seam, balancing."""

from model.moe.balance import Balancer, BalanceStats
from model.moe.dispatch import Dispatcher, LocalDispatcher, combine_slots, sort_by_expert
from model.moe.experts import LatentExperts
from model.moe.layer import LatentMoE, RouterStats
from model.moe.router import Router, Routing, select_experts

__all__ = [
    "BalanceStats",
    "Balancer",
    "Dispatcher",
    "LatentExperts",
    "LatentMoE",
    "LocalDispatcher",
    "Router",
    "RouterStats",
    "Routing",
    "combine_slots",
    "select_experts",
    "sort_by_expert",
]
