"""Fault 6: malformed data records (bad JSON, missing field, invalid UTF-8, empty lines, gigantic lines) are
skipped and counted, and the counts reach metrics.jsonl; training goes on."""

from __future__ import annotations

import math

from tests.fault.conftest import BASE_STEPS


def test_malformed_records_are_skipped_and_counted_in_metrics(base_run):
    last = base_run.metrics[-1]
    assert last["step"] == BASE_STEPS
    assert last["data/skipped_total"] == sum(base_run.bad_counts.values())
    assert all(math.isfinite(r["loss"]) for r in base_run.metrics)


def test_skip_counts_never_decrease(base_run):
    counts = [r["data/skipped_total"] for r in base_run.metrics]
    assert counts == sorted(counts) and counts[0] >= 1
