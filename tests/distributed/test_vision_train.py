"""Image–text training under DeepSpeed (issue 23 §4): 2 ranks, EP=2 + ZeRO-2, on synthetic image–caption batches
reproduce 1 process (same global batch as GA=2) within 1e-5, losses and grad norms; JSONL counts the images."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.distributed.conftest import must_succeed, run_training

pytestmark = pytest.mark.distributed
STEPS = 3
VLM = [
    "experiment=vlm_smoke",
    "callbacks=[]",
    "logging.mode=disabled",
    "logging.every=1",
    f"train.steps={STEPS}",
    "train.micro_batch_size=2",
    "checkpoint.save_final=false",
    "data.sources.0.size=256",
    "data.shuffle_buffer=32",
]


@pytest.fixture(scope="module")
def vlm_runs(runs_root):
    """(2 ranks EP=2 + ZeRO-2, 1 process GA=2): the same 4-row global batches."""
    with ThreadPoolExecutor(2) as pool:
        two = pool.submit(run_training, runs_root / "vlm_ep2", [*VLM, "parallel=ep2", "train.grad_accum=1"])
        one = pool.submit(run_training, runs_root / "vlm_one", [*VLM, "train.grad_accum=2"], nproc=1, launcher=False)
        return must_succeed(two.result()), must_succeed(one.result())


def test_two_ranks_ep2_zero2_reproduce_one_process(vlm_runs):
    two, one = vlm_runs
    got, ref = two.losses(), one.losses()
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    norms = {int(r["step"]): r["grad_norm"] for r in one.metrics if "grad_norm" in r}
    for r in two.metrics:
        if "loss" in r:
            assert r["loss"] == pytest.approx(ref[r["step"]], rel=1e-5), r["step"]
            assert r["grad_norm"] == pytest.approx(norms[r["step"]], rel=1e-5), r["step"]


def test_metrics_count_images_and_their_token_fraction(vlm_runs):
    rec = [r for r in vlm_runs[0].metrics if "loss" in r][-1]
    assert rec["data/images"] >= 4 * STEPS  # every conversation holds one image
    assert 0 < rec["data/image_token_fraction"] < 1
