"""Router-balance metrics: each value against its definition computed the slow way."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from training.metrics.router import bucket_experts, router_metrics


def _ref_layer(loads: list[float]) -> dict[str, float]:
    n = len(loads)
    mean = sum(loads) / n
    var = sum((x - mean) ** 2 for x in loads) / n
    return {
        "maxvio": max(loads) / mean - 1.0,
        "load_cv": math.sqrt(var) / mean,
        "dead_frac": sum(1 for x in loads if x == 0) / n,
        "min_load": min(loads),
        "max_load": max(loads),
    }


def test_per_layer_stats_match_definitions():
    counts = torch.randint(0, 50, (5, 13))
    counts[2, :4] = 0
    out = router_metrics(counts, None, layer_ids=[1, 2, 3, 5, 7])
    for row, lid in enumerate([1, 2, 3, 5, 7]):
        ref = _ref_layer([float(x) for x in counts[row]])
        for name, v in ref.items():
            assert out[f"router/layer{lid}/{name}"] == pytest.approx(v, rel=1e-12, abs=1e-12)


def test_perfectly_balanced_load_has_zero_maxvio_cv_and_no_dead_experts():
    out = router_metrics(torch.full((3, 16), 7), None, [1, 2, 3])
    assert out["router/maxvio"] == 0.0 and out["router/load_cv"] == 0.0 and out["router/dead_frac"] == 0.0


def test_layer_without_tokens_reports_zero_ratios_not_nan():
    out = router_metrics(torch.zeros(1, 8, dtype=torch.long), None, [1])
    assert out["router/layer1/maxvio"] == 0.0 and out["router/layer1/dead_frac"] == 1.0


def test_aggregates_are_mean_max_and_p90_over_layers():
    counts = torch.randint(1, 100, (11, 32))
    out = router_metrics(counts, None, list(range(1, 12)))
    per = np.array([out[f"router/layer{i}/maxvio"] for i in range(1, 12)])
    assert out["router/maxvio"] == pytest.approx(per.mean())
    assert out["router/maxvio_max"] == pytest.approx(per.max())
    assert out["router/maxvio_p90"] == pytest.approx(np.percentile(per, 90))
    cv = np.array([out[f"router/layer{i}/load_cv"] for i in range(1, 12)])
    assert out["router/load_cv"] == pytest.approx(cv.mean())


def test_bias_stats_per_layer():
    b = torch.randn(2, 9, dtype=torch.float32)
    out = router_metrics(torch.ones(2, 9), b, [4, 8])
    for row, lid in enumerate([4, 8]):
        x = b[row].double().numpy()
        assert out[f"router/layer{lid}/bias_mean"] == pytest.approx(x.mean())
        assert out[f"router/layer{lid}/bias_std"] == pytest.approx(x.std())
        assert out[f"router/layer{lid}/bias_absmax"] == pytest.approx(np.abs(x).max())


def test_extra_balancer_metrics_go_under_layer_prefix_and_are_averaged():
    extra = [{"qb_estimate_error": 0.1, "aux_loss": 2.0}, {"qb_estimate_error": 0.3, "aux_loss": 4.0}]
    out = router_metrics(torch.ones(2, 4), None, [1, 2], extra=extra)
    assert out["router/layer2/qb_estimate_error"] == pytest.approx(0.3)
    assert out["router/qb_estimate_error"] == pytest.approx(0.2)
    assert out["router/aux_loss"] == pytest.approx(3.0)


def test_bucketing_caps_columns_and_keeps_each_layers_total_at_k3_scale():
    counts = torch.randint(0, 1000, (92, 896))
    b = bucket_experts(counts, max_columns=128)
    assert b.shape == (92, 128)
    assert (b.sum(axis=1) == counts.double().sum(dim=1).numpy()).all()
    odd = bucket_experts(torch.ones(2, 130), max_columns=128)  # 2 experts per bucket, last bucket padded
    assert odd.shape == (2, 65) and odd.sum() == 260


def test_mismatched_layer_ids_is_a_one_line_error():
    with pytest.raises(ValueError, match="one id per MoE layer"):
        router_metrics(torch.ones(3, 4), None, [1, 2])
