"""Expert load balancing: `quantile` (K3 Quantile Balancing), `sign` (DeepSeek-V3), `aux` (sequence loss), `none`.

Statistics are accumulated during training-mode forwards (any number of micro-batches) and applied to the
router's `e_score_correction_bias` by `update(reducer)` once per optimizer step, then cleared. `reducer` reduces
over the data-parallel group; the statistics are chosen so that the result depends only on the *global* batch,
not on how it is split over ranks and micro-batches:

- quantile/exact: every margin r_ij of the global batch (`reducer.cat`), then a per-expert sort;
- quantile/histogram: per-expert bin counts over a range fixed by the current bias (`reducer.sum`, integers);
- sign: tokens per expert (`reducer.sum`, integers).

Quantile Balancing (spec §5): alpha_i = (k+1)-th largest of s_i + b, r_ij = alpha_i - s_ij. Expert j is in token
i's top-k iff b_j > r_ij, so setting b_j to the k/E quantile of {r_ij}_i gives each expert k/E of the tokens (for
the observed batch); then b <- b - mean(b), which changes no selection. With grouped top-k the margins are taken
over all experts (groups are ignored by the estimate). Expert j enters with r_ij < b_j, so a quantile q puts
q*m tokens strictly below: the exact estimator uses linear interpolation at rank q*m - 1/2 between order
statistics (the midpoint of the gap between the (qm)-th and (qm+1)-th smallest), the histogram estimator
interpolates linearly inside the bin where the cumulative count reaches q*m.

If activation checkpointing re-runs a MoE forward in training mode, wrap the recomputation in
`balancer.paused()` or the statistics count those tokens twice.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch

from model.config import K3Config
from model.moe.router import Router


class StatsReducer(Protocol):
    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce sum over the data-parallel group."""
        ...

    def cat(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather and concatenate along dim 0 (ranks may hold different lengths)."""
        ...


class LocalReducer:
    """Single process: nothing to reduce."""

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def cat(self, t: torch.Tensor) -> torch.Tensor:
        return t


def qb_margins(scores_NE: torch.Tensor, bias_E: torch.Tensor, k: int) -> torch.Tensor:
    """r_ij = alpha_i - s_ij with alpha_i the (k+1)-th largest of s_i + b: [N, E] in >= fp32."""
    s = scores_NE.detach()
    biased = s + bias_E.to(s.dtype)
    alpha_N1 = torch.topk(biased, k + 1, dim=-1).values[:, k:k + 1]
    return alpha_N1 - s


def exact_quantile(r_NE: torch.Tensor, q: float) -> torch.Tensor:
    """Per-column value with a fraction q of the rows strictly below it (midpoint interpolation): [E]."""
    n = r_NE.shape[0]
    sorted_NE = torch.sort(r_NE, dim=0).values
    pos = min(max(q * n - 0.5, 0.0), n - 1.0)  # 0-based fractional rank
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_NE[lo] * (1 - frac) + sorted_NE[hi] * frac


def histogram_counts(r_NE: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    """Per-expert counts of r over `bins` equal bins on [lo, hi), plus an under- and overflow bin: [E, bins+2]."""
    N, E = r_NE.shape
    width = (hi - lo) / bins
    b = torch.floor((r_NE.double() - lo) / width).clamp_(-1, bins).long() + 1  # 0 = underflow, bins+1 = overflow
    flat = b + torch.arange(E, device=r_NE.device).unsqueeze(0) * (bins + 2)
    return torch.bincount(flat.reshape(-1), minlength=E * (bins + 2)).view(E, bins + 2)


def histogram_quantile(counts_EB: torch.Tensor, lo: float, hi: float, q: float) -> torch.Tensor:
    """Value where the cumulative count reaches q*total, interpolated linearly inside its bin: [E] float64."""
    E, B2 = counts_EB.shape
    bins = B2 - 2
    width = (hi - lo) / bins
    c = counts_EB.double()
    cum = c.cumsum(1)  # [E, bins+2]
    target = q * cum[:, -1:]  # [E, 1]
    j = torch.searchsorted(cum.contiguous(), target).clamp_(0, B2 - 1)  # first bin with cum >= target
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    in_bin = c.gather(1, j).clamp(min=1)
    frac = ((target - before) / in_bin).clamp(0, 1)
    inner = (j - 1).double()  # index of the regular bin (-1 underflow, bins overflow)
    val = lo + (inner + frac) * width
    val = torch.where(j == 0, torch.full_like(val, lo), val)
    val = torch.where(j == B2 - 1, torch.full_like(val, hi), val)
    return val.squeeze(1)


def sequence_aux_loss(scores_NE: torch.Tensor, expert_idx_NK: torch.Tensor, batch: int, coef: float) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss, averaged over the `batch` rows (sequences) of length T = N/batch.

    Per sequence: f_j = E/(K*T) * #{t: j in I_t}, P_j = mean_t s_tj / sum_e s_te; loss = coef * sum_j f_j P_j.
    Differentiable w.r.t. the scores (f is a constant count).
    """
    N, E = scores_NE.shape
    K = expert_idx_NK.shape[1]
    T = N // batch
    s_BTE = scores_NE.reshape(batch, T, E)
    p_BE = (s_BTE / s_BTE.sum(-1, keepdim=True)).mean(1)
    onehot = torch.zeros(batch, T * K, E, dtype=s_BTE.dtype, device=s_BTE.device)
    onehot.scatter_(2, expert_idx_NK.reshape(batch, T * K, 1), 1.0)
    f_BE = onehot.sum(1) * (E / (K * T))
    return coef * (f_BE * p_BE).sum(-1).mean()


class Balancer:
    """Accumulates routing statistics in training forwards and applies them to the router bias in `update`.

    A plain object (not an nn.Module): it owns no parameters and nothing to checkpoint, because statistics are
    cleared at every optimizer step; it writes `router.e_score_correction_bias` in place.
    """

    def __init__(self, config: K3Config, router: Router) -> None:
        self.mode = config.moe_balance
        self.estimator = config.moe_balance_estimator
        self.bins = config.moe_balance_bins
        self.gamma = config.moe_sign_update_rate
        self.aux_coef = config.moe_aux_loss_coef
        self.num_experts = config.num_experts
        self.k = config.num_experts_per_token
        self._router = [router]  # in a list so nn.Module attribute magic never registers it twice
        self._paused = False
        self.clear()

    @property
    def bias(self) -> torch.Tensor:
        return self._router[0].e_score_correction_bias

    def clear(self) -> None:
        self._margins: list[torch.Tensor] = []
        self._hist: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._range: tuple[float, float] | None = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside this block record nothing (activation-checkpoint recomputation)."""
        prev, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = prev

    def observe(self, scores_NE: torch.Tensor, expert_idx_NK: torch.Tensor) -> None:
        """Record one micro-batch's routing (called by LatentMoE.forward in training mode)."""
        if self._paused:
            return
        with torch.no_grad():
            counts = torch.bincount(expert_idx_NK.reshape(-1), minlength=self.num_experts)
            self._counts = counts if self._counts is None else self._counts + counts
            if self.mode != "quantile":
                return
            r_NE = qb_margins(scores_NE, self.bias, self.k)
            if self.estimator == "exact":
                self._margins.append(r_NE.double())
            else:
                if self._range is None:
                    b = self.bias.double()
                    self._range = (float(b.min()) - 1.0, float(b.max()) + 1.0)
                h = histogram_counts(r_NE, *self._range, self.bins)
                self._hist = h if self._hist is None else self._hist + h

    def aux_loss(self, scores_NE: torch.Tensor, expert_idx_NK: torch.Tensor, batch: int) -> torch.Tensor | None:
        """The differentiable sequence-wise loss when mode == 'aux', else None."""
        if self.mode != "aux":
            return None
        return sequence_aux_loss(scores_NE, expert_idx_NK, batch, self.aux_coef)

    @torch.no_grad()
    def update(self, reducer: StatsReducer | None = None) -> dict[str, float]:
        """Apply the accumulated statistics to the bias (once per optimizer step), clear them, return metrics.

        Collective: every rank must call it (with the same reducer) even if it saw no tokens. Metrics:
        load_cv, maxvio (global batch), bias_mean/std/absmax (after the update), qb_est_error (exact QB: max over
        experts of |fraction of margins below the new bias - k/E|, before centring).
        """
        reducer = reducer or LocalReducer()
        metrics: dict[str, float] = {}
        bias = self.bias
        E, q = self.num_experts, self.k / self.num_experts
        local = self._counts if self._counts is not None else torch.zeros(E, dtype=torch.long, device=bias.device)
        load = reducer.sum(local.to(bias.device)).double()
        if float(load.sum()) > 0:
            metrics["load_cv"] = float(load.std(unbiased=False) / load.mean())
            metrics["maxvio"] = float(load.max() / load.mean() - 1.0)
            if self.mode == "sign":
                bias.add_(self.gamma * torch.sign(load.mean() - load).to(bias.dtype))
            elif self.mode == "quantile":
                bias.copy_(self._quantile_bias(reducer, q, metrics).to(bias.dtype))
        b = bias.double()
        metrics.update(bias_mean=float(b.mean()), bias_std=float(b.std(unbiased=False)),
                       bias_absmax=float(b.abs().max()))
        self.clear()
        return metrics

    def _quantile_bias(self, reducer: StatsReducer, q: float, metrics: dict[str, float]) -> torch.Tensor:
        """New centred QB bias from the global statistics (float64)."""
        E, dev = self.num_experts, self.bias.device
        if self.estimator == "exact":
            local_r = torch.cat(self._margins) if self._margins else torch.zeros(0, E, dtype=torch.float64,
                                                                                 device=dev)
            r_NE = reducer.cat(local_r)
            new_b = exact_quantile(r_NE, q)
            metrics["qb_est_error"] = float(((r_NE < new_b).double().mean(0) - q).abs().max())
        else:
            lo, hi = self._range if self._range is not None else self._hist_range()
            local_h = self._hist if self._hist is not None else torch.zeros(E, self.bins + 2, dtype=torch.long,
                                                                            device=dev)
            new_b = histogram_quantile(reducer.sum(local_h), lo, hi, q)
        return new_b - new_b.mean()

    def _hist_range(self) -> tuple[float, float]:
        b = self.bias.double()
        return float(b.min()) - 1.0, float(b.max()) + 1.0
