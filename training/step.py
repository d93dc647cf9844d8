"""One optimizer step's inputs and outputs: micro-batch preparation and the typed result callbacks read.

Loss normalisation: each micro-batch's mean CE is rescaled by (its target count x DP x GA / global target count)
so that after DeepSpeed's 1/GA scaling and DP averaging the gradient is that of the global-batch token mean, the
same for any split of the global batch into ranks and micro-batches (DP=2,GA=1 == DP=1,GA=2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from model.k3 import IGNORE_INDEX, shift_targets


@dataclass
class MicroBatch:
    """One micro-batch as one packed row: ids/labels [1, N], document boundaries, targets the CE counts."""

    ids_1N: torch.Tensor
    labels_1N: torch.Tensor
    cu_seqlens: torch.Tensor
    n_targets: int


def pack_microbatch(mb: dict[str, Any]) -> MicroBatch:
    """[b, T] rows -> one packed [1, b*T] stream with cu_seqlens. The model masks cross-document targets itself
    (`shift_targets`); the same function counts them here, before the forward, for the loss weights."""
    ids_1N = mb["input_ids"].reshape(1, -1).long()
    labels_1N = mb["labels"].reshape(1, -1).long()
    cu = torch.as_tensor(mb["cu_seqlens"], dtype=torch.int64)
    n = int((shift_targets(labels_1N, cu) != IGNORE_INDEX).sum())
    return MicroBatch(ids_1N, labels_1N, cu, n)


@dataclass
class StepResult:
    """What one optimizer step produced (identical on every rank): global-batch values only."""

    loss: float  # global-batch token-mean CE (without the aux loss)
    lr: float
    grad_norm: float
    tokens: int  # tokens of the global batch
    loss_tokens: int  # targets the loss averaged over
    skipped: bool  # non-finite step: weights, optimizer, schedule and router biases untouched
    aux_loss: float | None = None
    counts_LE: torch.Tensor | None = None  # [L, E] global tokens per expert of the MoE layers
    balance_extra: list[dict[str, float]] = field(default_factory=list)  # per MoE layer, from the balancers
