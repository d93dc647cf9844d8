"""One optimizer step's routing statistics: summed over micro-batches, reduced once, applied by the balancers.

The model's forward returns one `BalanceStats` per MoE layer (model/moe/balance.py). The trainer merges a step's
micro-batches (`StepRouting.add`), then `reduce_global` makes them global with one all-reduce (every layer's counts
and histograms as one int64 vector) plus, for exact Quantile Balancing, one all-gather of every layer's margins:
the result depends only on the global batch, not on how it was split over ranks and micro-batches. The global
counts feed both the balancers (`apply`) and the router metrics, so they are counted and reduced exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from model.moe import BalanceStats, RouterStats


class StatsReducer(Protocol):
    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce sum over the data-parallel group."""
        ...

    def cat(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather and concatenate along dim 0 (ranks may hold different lengths)."""
        ...


@dataclass
class StepRouting:
    """This rank's routing statistics of one optimizer step, one BalanceStats per MoE layer (layer order)."""

    layers: list[BalanceStats] = field(default_factory=list)

    def add(self, router_stats: Sequence[RouterStats]) -> None:
        fresh = [_detached(s.balance) for s in router_stats]
        self.layers = fresh if not self.layers else [a.merge(b) for a, b in zip(self.layers, fresh)]

    def reduce_global(self, reducer: StatsReducer) -> list[BalanceStats]:
        """Global-batch statistics of every layer (collective: every rank calls it, in the same order)."""
        if not self.layers:
            return []
        ints = [s.counts_E.long().reshape(-1) for s in self.layers]
        hist = [s.hist_EB for s in self.layers]
        ints += [h.long().reshape(-1) for h in hist if h is not None]
        flat = reducer.sum(torch.cat(ints))
        E = self.layers[0].counts_E.numel()
        counts = list(flat[: E * len(self.layers)].view(len(self.layers), E))
        out = [BalanceStats(c) for c in counts]
        pos = E * len(self.layers)
        for s, h in zip(out, hist):
            if h is not None:
                s.hist_EB = flat[pos : pos + h.numel()].view_as(h)
                pos += h.numel()
        with_margins = [i for i, s in enumerate(self.layers) if s.margins_NE is not None]
        if with_margins:  # every layer routed the same local tokens: one gather for all of them
            r_NLE = reducer.cat(torch.stack([self.layers[i].margins_NE for i in with_margins], dim=1))
            for j, i in enumerate(with_margins):
                out[i].margins_NE = r_NLE[:, j]
        return out


def _detached(s: BalanceStats) -> BalanceStats:
    def d(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach()  # stays on its device: no host sync per micro-batch

    return BalanceStats(d(s.counts_E), d(s.margins_NE), d(s.hist_EB))  # type: ignore[arg-type]


def apply(moe_layers: Sequence[nn.Module], global_stats: Sequence[BalanceStats]) -> list[dict[str, float]]:
    """Each layer's balancer updates its router bias from the global statistics; returns per-layer extras
    for the router metrics (the exact QB estimate error where there is one), read from the device together."""
    errs = [moe.balancer.update_on_device(stats) for moe, stats in zip(moe_layers, global_stats)]
    present = [e for e in errs if e is not None]
    values = iter(torch.stack(present).tolist() if present else [])  # one host read per step
    return [{} if e is None else {"qb_est_error": next(values)} for e in errs]


def counts_LE(global_stats: Sequence[BalanceStats]) -> torch.Tensor | None:
    """[L, E] global tokens per expert, for the router metrics."""
    return torch.stack([s.counts_E for s in global_stats]).cpu() if global_stats else None


def biases_LE(moe_layers: Sequence[nn.Module]) -> torch.Tensor | None:
    """[L, E] selection biases after the update, for the router metrics."""
    if not moe_layers:
        return None
    return torch.stack([m.gate.e_score_correction_bias.detach().float().cpu() for m in moe_layers])
