"""Which way a metric is better: lower for losses (loss, ppl, bpb, loss_pos), higher for accuracies and log-probs.
The W&B summary, `best/...` in summary.json and `checkpoint.keep_best` all read it."""

from __future__ import annotations

_LOWER = ("loss", "ppl", "bpb", "loss_pos")
_HIGHER = ("acc", "acc_norm", "logprob")


def goal(metric: str) -> str | None:
    """ "min" | "max" for a metric key eval/<name>/<metric>, None when it has no better direction (time_s, n)."""
    leaf = metric.split("/", 2)[-1]
    head = leaf.split("/")[0].split("@")[0]
    if head in _LOWER:
        return "min"
    if head in _HIGHER:
        return "max"
    return None
