"""Expert load balancing: `quantile` (K3 Quantile Balancing), `sign` (DeepSeek-V3), `aux` (sequence loss), `none`.

One channel for routing statistics: each training-mode MoE forward returns a `BalanceStats` (tokens per expert,
and for Quantile Balancing its margins or margin histogram) inside its RouterStats; nothing is accumulated inside
the model. The trainer sums a step's micro-batches (`BalanceStats.merge`), reduces them over the data-parallel
group once per step, and calls `Balancer.update(stats)` with the global statistics, which writes the router's
`e_score_correction_bias`. Because the statistics travel with the forward's output, an activation-checkpoint
recomputation or a skipped (non-finite) step simply never hands them to `update`. The statistics are chosen so
that the result depends only on the *global* batch, not on how it is split over ranks and micro-batches:

- quantile/exact: every margin r_ij of the global batch (concatenated), then a per-expert sort;
- quantile/histogram: per-expert bin counts over a range fixed by the current bias (summed, integers);
- sign: tokens per expert (summed, integers).

Quantile Balancing (docs/model.md §5): alpha_i = (k+1)-th largest of s_i + b, r_ij = alpha_i - s_ij. Expert j is in
token
i's top-k iff b_j > r_ij, so setting b_j to the k/E quantile of {r_ij}_i gives each expert k/E of the tokens (for
the observed batch); then b <- b - mean(b), which changes no selection. With grouped top-k the margins are taken
over all experts (groups are ignored by the estimate). Expert j enters with r_ij < b_j, so a quantile q puts
q*m tokens strictly below: the exact estimator uses linear interpolation at rank q*m - 1/2 between order
statistics (the midpoint of the gap between the (qm)-th and (qm+1)-th smallest), the histogram estimator
interpolates linearly inside the bin where the cumulative count reaches q*m.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import K3Config
from model.moe.router import Router


def count_per_expert(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 occurrences of each id in idx: bincount's values as a fixed-size scatter_add, which (unlike
    bincount, whose output size depends on max(idx)) never reads the data on the host."""
    flat = idx.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts_E.scatter_add_(0, flat, torch.ones_like(flat))


def qb_margins(scores_NE: torch.Tensor, bias_E: torch.Tensor, k: int) -> torch.Tensor:
    """r_ij = alpha_i - s_ij with alpha_i the (k+1)-th largest of s_i + b: [N, E] in >= fp32."""
    s = scores_NE.detach()
    biased = s + bias_E.to(s.dtype)
    alpha_N1 = torch.topk(biased, k + 1, dim=-1).values[:, k : k + 1]
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


def histogram_counts(r_NE: torch.Tensor, lo: float | torch.Tensor, hi: float | torch.Tensor, bins: int) -> torch.Tensor:
    """Per-expert counts of r over `bins` equal bins on [lo, hi), plus an under- and overflow bin: [E, bins+2]."""
    N, E = r_NE.shape
    width = (hi - lo) / bins
    b = torch.floor((r_NE.double() - lo) / width).clamp_(-1, bins).long() + 1  # 0 = underflow, bins+1 = overflow
    flat = (b + torch.arange(E, device=r_NE.device).unsqueeze(0) * (bins + 2)).reshape(-1)
    counts = torch.zeros(E * (bins + 2), dtype=torch.long, device=r_NE.device)  # bincount without a host read
    return counts.scatter_add_(0, flat, torch.ones_like(flat)).view(E, bins + 2)


def histogram_quantile(
    counts_EB: torch.Tensor, lo: float | torch.Tensor, hi: float | torch.Tensor, q: float
) -> torch.Tensor:
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
    lo_, hi_ = (torch.as_tensor(x, dtype=val.dtype, device=val.device) for x in (lo, hi))  # floats or 0-d
    val = torch.where(j == 0, lo_, val)
    val = torch.where(j == B2 - 1, hi_, val)
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


def histogram_range(bias_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The QB histogram's range, fixed by the current bias (the same on every rank and micro-batch of a step), as
    0-d float64 tensors on the bias' device: the forward's histogram reads nothing on the host."""
    lo, hi = torch.aminmax(bias_E.double())
    return lo - 1.0, hi + 1.0


@dataclass
class BalanceStats:
    """One MoE layer's routing statistics over some tokens: all that balancing and load metrics need.

    counts_E: [E] int64 (token, slot) assignments per global expert id.
    margins_NE: [N, E] float64 QB margins (quantile/exact), else None.
    hist_EB: [E, bins + 2] int64 QB margin histogram (quantile/histogram), else None.
    """

    counts_E: torch.Tensor
    margins_NE: torch.Tensor | None = None
    hist_EB: torch.Tensor | None = None

    def merge(self, other: BalanceStats) -> BalanceStats:
        """Statistics of both token sets (micro-batches of one step): counts and histograms add, margins concat."""

        def join(a, b, op):
            return b if a is None else a if b is None else op(a, b)

        return BalanceStats(
            self.counts_E + other.counts_E,
            join(self.margins_NE, other.margins_NE, lambda a, b: torch.cat([a, b])),
            join(self.hist_EB, other.hist_EB, torch.add),
        )


class Balancer:
    """Turns routing into statistics (`observe`, in forward) and global statistics into a new bias (`update`).

    A plain object (not an nn.Module) without state of its own: the bias it writes is the router's buffer, so
    checkpoints hold everything.
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

    @property
    def bias(self) -> torch.Tensor:
        return self._router[0].e_score_correction_bias

    @torch.no_grad()
    def observe(self, scores_NE: torch.Tensor, expert_idx_NK: torch.Tensor) -> BalanceStats:
        """This forward's statistics (counted once: the same counts serve balancing and metrics)."""
        counts_E = count_per_expert(expert_idx_NK, self.num_experts)
        if self.mode != "quantile":
            return BalanceStats(counts_E)
        r_NE = qb_margins(scores_NE, self.bias, self.k)
        if self.estimator == "exact":
            return BalanceStats(counts_E, margins_NE=r_NE.double())
        return BalanceStats(counts_E, hist_EB=histogram_counts(r_NE, *histogram_range(self.bias), self.bins))

    def aux_loss(self, scores_NE: torch.Tensor, expert_idx_NK: torch.Tensor, batch: int) -> torch.Tensor | None:
        """The differentiable sequence-wise loss when mode == 'aux', else None."""
        if self.mode != "aux":
            return None
        return sequence_aux_loss(scores_NE, expert_idx_NK, batch, self.aux_coef)

    @torch.no_grad()
    def update(self, stats: BalanceStats) -> float | None:
        """Apply one optimizer step's *global* statistics to the bias (quantile, sign; aux/none: no-op).

        Returns the exact QB estimate error (max over experts of |fraction of margins below the new bias - k/E|,
        before centring), else None. A step without tokens leaves the bias unchanged. One host read (the error);
        the trainer calls `update_on_device` for all layers and reads their errors together."""
        err = self.update_on_device(stats)
        return None if err is None else float(err)

    @torch.no_grad()
    def update_on_device(self, stats: BalanceStats) -> torch.Tensor | None:
        """`update` without any host read: the error, where there is one, as a 0-d tensor on the bias' device."""
        bias = self.bias
        if self.mode not in ("sign", "quantile"):
            return None
        load_E = stats.counts_E.to(bias.device).double()
        has_tokens = load_E.sum() > 0  # on the device: a step without tokens keeps the bias (torch.where below)
        if self.mode == "sign":  # sign(mean - load) is 0 everywhere when there are no tokens
            bias.add_(self.gamma * torch.sign(load_E.mean() - load_E).to(bias.dtype))
            return None
        q = self.k / self.num_experts
        err = None
        if stats.margins_NE is not None:
            r_NE = stats.margins_NE.to(bias.device)
            if r_NE.shape[0] == 0:  # no tokens (a shape: known on the host)
                return None
            new_b = exact_quantile(r_NE, q)
            err = ((r_NE < new_b).double().mean(0) - q).abs().max()
        elif stats.hist_EB is not None:
            new_b = histogram_quantile(stats.hist_EB.to(bias.device), *histogram_range(bias), q)
        else:
            raise ValueError(
                "quantile balancing needs margins or a histogram in BalanceStats; pass the "
                "statistics returned by this balancer's observe()"
            )
        bias.copy_(torch.where(has_tokens, (new_b - new_b.mean()).to(bias.dtype), bias))
        return err
