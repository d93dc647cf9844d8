"""Router-balance metrics from global-batch expert loads.

Why: an MoE run silently degrades when a few experts take most tokens (MaxVio grows) or some never fire (dead
experts). These numbers are computed once per logged step from the all-reduced token counts per expert, so they
describe the *global* batch, independent of how it was split over ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

PREFIX = "router"
_PER_LAYER_AGGREGATED = ("maxvio", "load_cv", "dead_frac")  # also aggregated with max and p90


def _np64(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """float64 numpy copy of a tensor (any device) or array; numpy only, so offline tools skip importing torch."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    return np.asarray(x, dtype=np.float64)


def load_balance_stats(counts_LE: torch.Tensor | np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer load statistics, each a [L] float64 array.

    maxvio = max_j load_j / mean_j load_j - 1 (0 when perfectly balanced; DeepSeek/K3 "MaxVio"),
    load_cv = std_j load_j / mean_j load_j (population std), dead_frac = fraction of experts with load 0,
    min_load / max_load as raw token counts. A layer that saw no tokens reports 0 for the ratios.
    """
    if len(counts_LE.shape) != 2:
        raise ValueError(f"counts_LE must be [n_moe_layers, num_experts], got shape {tuple(counts_LE.shape)}")
    c_LE = _np64(counts_LE)
    mean_L = c_LE.mean(axis=1)
    safe_L = np.where(mean_L > 0, mean_L, 1.0)
    has_L = mean_L > 0
    return {
        "maxvio": np.where(has_L, c_LE.max(axis=1) / safe_L - 1.0, 0.0),
        "load_cv": np.where(has_L, c_LE.std(axis=1) / safe_L, 0.0),
        "dead_frac": (c_LE == 0).mean(axis=1),
        "min_load": c_LE.min(axis=1),
        "max_load": c_LE.max(axis=1),
    }


def bias_stats(biases_LE: torch.Tensor | np.ndarray) -> dict[str, np.ndarray]:
    """Per-layer statistics of the selection bias b (e_score_correction_bias), each [L] float64."""
    b_LE = _np64(biases_LE)
    return {"bias_mean": b_LE.mean(axis=1), "bias_std": b_LE.std(axis=1), "bias_absmax": np.abs(b_LE).max(axis=1)}


def router_metrics(
    counts_LE: torch.Tensor | np.ndarray,
    biases_LE: torch.Tensor | np.ndarray | None,
    layer_ids: Sequence[int],
    extra: Sequence[dict[str, Any]] | None = None,
) -> dict[str, float]:
    """Flat `router/...` metrics: per layer `router/layer{i}/<name>` and cross-layer aggregates.

    counts_LE: [n_moe_layers, E] global-batch token counts per expert (after the DP all-reduce).
    biases_LE: [n_moe_layers, E] selection biases or None (e.g. balance == 'none').
    layer_ids: the decoder-layer index of each row (naming only), e.g. [1, 2, ..., L-1].
    extra: one dict per row of scalars from the balancer (QB estimate error, aux loss, ...), logged under the same
        per-layer prefix and averaged across layers as `router/<name>`.
    Aggregates: `router/<m>` is the mean over layers for maxvio, load_cv, dead_frac, bias_*; `router/<m>_max` and
    `router/<m>_p90` for maxvio, load_cv, dead_frac.
    """
    L = counts_LE.shape[0] if len(counts_LE.shape) >= 1 else 0
    if len(layer_ids) != L:
        raise ValueError(
            f"layer_ids has {len(layer_ids)} entries but counts_LE has {L} rows; pass one id per MoE layer"
        )
    if biases_LE is not None and tuple(biases_LE.shape) != tuple(counts_LE.shape):
        raise ValueError(
            f"biases_LE shape {tuple(biases_LE.shape)} must equal counts_LE shape {tuple(counts_LE.shape)}"
        )
    if extra is not None and len(extra) != L:
        raise ValueError(f"extra has {len(extra)} dicts but there are {L} MoE layers; pass one dict per layer")
    if L == 0:
        return {}
    stats = load_balance_stats(counts_LE)
    if biases_LE is not None:
        stats.update(bias_stats(biases_LE))
    if extra is not None:
        names = sorted({k for d in extra for k in d})
        for name in names:
            stats[name] = np.array([float(d[name]) if d.get(name) is not None else np.nan for d in extra])

    out: dict[str, float] = {}
    for name, v_L in stats.items():
        for lid, v in zip(layer_ids, v_L.tolist()):
            out[f"{PREFIX}/layer{lid}/{name}"] = v
    for name, v_L in stats.items():
        if name in ("min_load", "max_load"):
            continue
        finite = v_L[~np.isnan(v_L)]
        if finite.size:
            out[f"{PREFIX}/{name}"] = float(finite.mean())
    for name in _PER_LAYER_AGGREGATED:
        out[f"{PREFIX}/{name}_max"] = float(stats[name].max())
        out[f"{PREFIX}/{name}_p90"] = float(np.percentile(stats[name], 90))
    out[f"{PREFIX}/min_load"] = float(stats["min_load"].min())
    out[f"{PREFIX}/max_load"] = float(stats["max_load"].max())
    return out


def bucket_experts(counts_LE: torch.Tensor | np.ndarray, max_columns: int = 128) -> np.ndarray:
    """Sum adjacent experts into <= max_columns buckets ([L, E] -> float64 [L, ceil(E / ceil(E/max_columns))]).

    Why: a 92 x 896 heatmap must stay one small image / table in W&B; bucketing by sum keeps the total load.
    """
    c_LE = _np64(counts_LE)
    L, E = c_LE.shape
    width = -(-E // max_columns)  # experts per bucket
    if width <= 1:
        return c_LE
    n_buckets = -(-E // width)
    pad = n_buckets * width - E
    if pad:
        c_LE = np.concatenate([c_LE, np.zeros((L, pad))], axis=1)
    return c_LE.reshape(L, n_buckets, width).sum(axis=2)
