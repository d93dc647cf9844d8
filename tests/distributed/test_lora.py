"""finetune=lora on 2 ranks, ZeRO-3 + EP=2 (expert adapters sharded with their experts, the frozen base
partitioned) reproduces 1 rank on sft_tiny-style chat data (loss on assistant turns): losses and adapters."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file

from tests.distributed.conftest import must_succeed, run_training
from tests.lora_base import make_base

pytestmark = pytest.mark.distributed
STEPS = 8


def _job(base) -> list[str]:
    return [
        "experiment=sft_tiny",
        "finetune=lora",
        f"model.init_from={base}",
        "train.loss_on=assistant",
        "deepspeed=zero3",
        f"train.steps={STEPS}",
        "logging.every=1",
        "logging.mode=disabled",
    ]


@pytest.fixture(scope="module")
def runs(runs_root):
    base = make_base(runs_root / "lora-base-hf")
    with ThreadPoolExecutor(2) as pool:  # independent jobs: at once
        one = pool.submit(run_training, runs_root / "lora-1", [*_job(base), "train.micro_batch_size=2"], 1, None, False)
        two = pool.submit(
            run_training, runs_root / "lora-2", [*_job(base), "train.micro_batch_size=1", "parallel=ep2"], 2
        )
        return must_succeed(one.result()), must_succeed(two.result())


def test_two_ranks_zero3_ep2_reproduce_one_rank_losses(runs):
    one, two = runs
    a, b = one.losses(), two.losses()
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert max(abs(a[s] - b[s]) for s in a) < 1e-5


def test_two_ranks_train_the_same_adapters(runs):
    tag = f"checkpoints/step_{STEPS:08d}/adapters.safetensors"
    one, two = (load_file(r.run_dir / tag) for r in runs)
    assert one.keys() == two.keys() and any(".experts.lora." in k for k in one)
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
