"""One optimizer step's inputs and outputs: micro-batch preparation and the typed result callbacks read.

Loss normalisation: each micro-batch's mean CE is rescaled by (its target count x DP x GA / global target count)
so that after DeepSpeed's 1/GA scaling and DP averaging the gradient is that of the global-batch token mean, the
same for any split of the global batch into ranks and micro-batches (DP=2,GA=1 == DP=1,GA=2). DP counts ranks with
different rows (world / sp_size): DeepSpeed sums a sequence-parallel group's partial gradients before dividing by
it (training/parallel/ulysses.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from model.k3 import IGNORE_INDEX, shift_targets
from model.mtp import depth_targets


@dataclass
class MicroBatch:
    """One micro-batch as one packed row: ids/labels [1, N], document boundaries, targets the CE counts.
    Under sequence parallelism ids and targets are this rank's slice [1, N/S], labels None, cu_seqlens whole."""

    ids_1N: torch.Tensor
    labels_1N: torch.Tensor | None
    cu_seqlens: torch.Tensor
    n_targets: int
    targets_1N: torch.Tensor | None = None  # shifted already (sequence parallelism); else the model shifts labels
    pixel_values: torch.Tensor | None = None  # [N, 3, p, p] patches of the rows' images, row-major (multimodal)
    grid_thws: torch.Tensor | None = None  # [n_images, 3]
    # sequence parallelism with images: <|media_pad|> tokens of the whole stream before this rank's slice; the
    # images are the whole group's rows' (every rank of the group runs the tower on all of them)
    media_offset: int | None = None
    # sequence parallelism with MTP: per depth k the whole micro-batch's main target count / its depth-k count
    mtp_factors: list[float] | None = None

    def objective(self, out: Any, mtp_weight: float, scale: float) -> torch.Tensor:
        """What this rank backprops: `scale` x its target count x the model's loss (main mean + mtp_weight x the
        mean of the depth means). Under sequence parallelism with MTP the depth means are the shard's, so the MTP
        part is the shard's depth-k CE sums times (mtp_weight / D) x n / c_k of the whole micro-batch: the
        shards' objectives add up to the 1-rank one (the main part already does: a sum of CE)."""
        n = self.n_targets
        if self.mtp_factors is None or out.mtp_loss is None:
            return out.loss * (n * scale) if n > 0 else out.loss * 0.0
        sums = [f * (l_k * c_k) for f, l_k, c_k in zip(self.mtp_factors, out.mtp_losses, out.mtp_counts)]
        mtp = torch.stack(sums).sum() * (mtp_weight / len(sums))
        return ((out.loss - out.mtp_loss) * n + mtp) * scale

    def model_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Keyword arguments of K3ForCausalLM.forward (and K3ForConditionalGeneration's, with images)."""
        out = {"input_ids": self.ids_1N.to(device), "cu_seqlens": self.cu_seqlens.to(device)}
        out["cu_seqlens_cpu"] = self.cu_seqlens.cpu()  # the loader's host copy: the model reads none from the device
        if self.pixel_values is not None and self.grid_thws is not None:
            out["pixel_values"], out["grid_thws"] = self.pixel_values.to(device), self.grid_thws.to(device)
            if self.media_offset is not None:
                out["media_offset"] = self.media_offset
        if self.targets_1N is not None:
            out["targets"] = self.targets_1N.to(device)
        else:
            assert self.labels_1N is not None
            out["labels"] = self.labels_1N.to(device)
        return out


def pack_microbatch(
    mb: dict[str, Any], sp_size: int = 1, sp_rank: int = 0, media_id: int | None = None, mtp_depth: int = 0
) -> MicroBatch:
    """[b, T] rows -> one packed [1, b*T] stream with cu_seqlens. The model masks cross-document targets itself
    (`shift_targets`); the same function counts them here, before the forward, for the loss weights.

    `sp_size` > 1: the rows are the sequence-parallel group's, and this rank keeps tokens [r*N/S, (r+1)*N/S) with
    their targets, shifted on the whole stream (the last token of a slice predicts the next slice's first), and
    all the rows' images with the count of `media_id` tokens before its slice (`media_offset`): image features are
    computed before the split, on every rank of the group, and each rank scatters the ones its slice holds; with
    `mtp_depth` the whole stream's n / c_k per MTP depth (`MicroBatch.objective`)."""
    ids_1N = mb["input_ids"].reshape(1, -1).long()
    labels_1N = mb["labels"].reshape(1, -1).long()
    cu = torch.as_tensor(mb["cu_seqlens"], dtype=torch.int64)
    targets_1N = shift_targets(labels_1N, cu)
    if sp_size == 1:
        n = int((targets_1N != IGNORE_INDEX).sum())
        return MicroBatch(ids_1N, labels_1N, cu, n, None, mb.get("pixel_values"), mb.get("grid_thws"))
    n = ids_1N.shape[1] // sp_size
    mine = slice(sp_rank * n, (sp_rank + 1) * n)
    local_1n = targets_1N[:, mine]
    pixels, grids = mb.get("pixel_values"), mb.get("grid_thws")
    offset = int(ids_1N[:, : mine.start].eq(media_id).sum()) if pixels is not None and media_id is not None else None
    whole = int((targets_1N != IGNORE_INDEX).sum())
    counts = [int((depth_targets(targets_1N, k, cu) != IGNORE_INDEX).sum()) for k in range(1, mtp_depth + 1)]
    factors = [whole / c if c else 0.0 for c in counts] if mtp_depth else None
    n_mine = int((local_1n != IGNORE_INDEX).sum())
    return MicroBatch(ids_1N[:, mine], None, cu, n_mine, local_1n, pixels, grids, offset, factors)


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
    metrics: dict[str, float] = field(default_factory=dict)  # more logged values (QK-Clip's attn/, optim/)
