"""Held-out loss of a LossSet: the sum of target-token CE over every rank / the set's global target count.

Metrics (`eval/<set>/...`): `loss` (nats per target token), `ppl` = exp(loss), `bpb` = total nats / ln 2 / UTF-8
bytes of the targets' text (comparable across tokenizers), `loss_pos/<lo>-<hi>` (the loss of the targets predicted
from positions [lo, hi) of their document segment: does the model use its context?) and `time_s`. The count and
the bytes are known on every rank from the rows themselves; only the CE sums travel (one all-reduce per set), so
the value is the same at any data / expert / sequence parallelism, ZeRO stage and batch split.
"""

from __future__ import annotations

import math
import time

import torch

from training.eval.forward import EvalContext, pad_rows, reduce_sum, score_rows, shard_rows
from training.eval.sets import LossSet, position_buckets


def evaluate_loss(ctx: EvalContext, s: LossSet) -> dict[str, float]:
    t0 = time.perf_counter()
    buckets = position_buckets(s.ids_RT.shape[1])
    sums_K = torch.zeros(1 + 2 * len(buckets), dtype=torch.float64)  # total CE, then per bucket CE and count
    for index in shard_rows(s.rows, ctx):
        ids, labels, starts = pad_rows(s.ids_RT, s.labels_RT, s.starts, index)
        sc = score_rows(ctx, ids, labels, starts)
        pos_N = torch.stack([s.pos_RT[i] if i is not None else torch.zeros_like(s.pos_RT[0]) for i in index]).reshape(
            -1
        )
        sums_K[0] += sc.nll_N.sum()
        counted_N = sc.targets_N != -100
        for k, (lo, hi) in enumerate(buckets):
            in_k = counted_N & (pos_N >= lo) & (pos_N < hi)
            sums_K[1 + 2 * k] += sc.nll_N[in_k].sum()
            sums_K[2 + 2 * k] += float(in_k.sum()) / ctx.sp_size  # every rank of a group counts the whole stream
    tot = reduce_sum(sums_K)
    loss = float(tot[0]) / s.n_targets
    out = {
        "loss": loss,
        "ppl": math.exp(min(loss, 700.0)),
        "bpb": float(tot[0]) / math.log(2) / max(1, s.n_bytes),
    }
    for k, (lo, hi) in enumerate(buckets):
        n = float(tot[2 + 2 * k])
        if n > 0:
            out[f"loss_pos/{lo}-{hi}"] = float(tot[1 + 2 * k]) / n
    out["time_s"] = time.perf_counter() - t0
    return out
