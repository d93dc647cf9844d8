"""Training metrics: router balance, FLOPs/MFU, hardware facts, and the rank-0 run logger (JSONL + W&B + progress).

Stable API used by training/train.py:
    RunLogger(run_dir, config, mode, project, run_id, total_steps, is_main, heatmap_every, resume)
        .log(step, metrics) .log_heatmap(step, counts_LE, layer_ids=None) .summary(dict) .run_id .close()
    router_metrics(counts_LE, biases_LE, layer_ids, extra=None) -> {"router/...": float}
    flops_per_token(config, seq_len, training=True) -> float;  mfu(tokens_per_s, flops_per_tok, peak)
    peak_flops(device=None) -> float;  memory_stats(device=None) -> {"memory/...": GiB}
Names are resolved lazily (PEP 562) so torch-free tools (training.report) can import submodules cheaply.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RunLogger": "training.metrics.logger",
    "router_metrics": "training.metrics.router",
    "bucket_experts": "training.metrics.router",
    "flops_per_token": "training.metrics.flops",
    "flops_breakdown": "training.metrics.flops",
    "matmul_params_active": "training.metrics.flops",
    "mfu": "training.metrics.flops",
    "peak_flops": "training.metrics.system",
    "memory_stats": "training.metrics.system",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'training.metrics' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
