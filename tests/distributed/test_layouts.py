"""The same global batch split as DP=2 x GA=1 (launcher) or DP=1 x GA=2 (one process) gives the same losses."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import REF, must_succeed, run_training

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def one_process_ga2(runs_root):
    over = [o for o in REF if not o.startswith(("train.grad_accum=", "checkpoint.every="))]
    return must_succeed(
        run_training(
            runs_root / "dp1_ga2",
            [*over, "train.grad_accum=2", "checkpoint.every=0", "logging.mode=disabled"],
            launcher=False,
        )
    )


def test_dp2_ga1_equals_dp1_ga2_losses(one_process_ga2, ref_run):
    got, ref = one_process_ga2.losses(), ref_run.losses()
    assert sorted(got) == sorted(ref)
    for s in ref:
        assert got[s] == pytest.approx(ref[s], rel=1e-5), s


def test_dp2_ga1_equals_dp1_ga2_router_loads(one_process_ga2, ref_run):
    for a, b in zip(one_process_ga2.metrics, ref_run.metrics):
        assert a["router/maxvio"] == pytest.approx(b["router/maxvio"], rel=1e-5, abs=1e-7)
        assert a["loss_tokens"] == b["loss_tokens"]
