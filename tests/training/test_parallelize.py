"""training/parallelize.py without a process group: what the trainer accepts and what it refuses up front.

Every combination DeepSpeed 0.19.8 refuses with AutoEP + ZeRO-3 (engine._validate_zero3_moe_compatibility and
_save_moe_checkpoint) must stop in `validate`, before any process group starts, with one line naming the
combination and the alternative.
"""

from __future__ import annotations

import pytest

from training.config import TrainConfigError, compose, validate
from training.engine import build_ds_config
from training.parallelize import LayoutError, check_layout

Z3EP = ["deepspeed=zero3", "parallel.ep_size=2"]


@pytest.mark.parametrize(
    "extra,needle,alternative",
    [
        (["+deepspeed.extra.zero_optimization.zero_hpz_partition_size=2"], "hpZ", "parallel.ep_size=1"),
        (["+deepspeed.extra.zero_optimization.zero_quantized_gradients=true"], "qgZ/LoCo", "drop"),
        (["+deepspeed.extra.zero_optimization.zeropp_loco_param={err_beta: 0.8}"], "qgZ/LoCo", "drop"),
        (["+deepspeed.extra.zero_optimization.mics_shard_size=2"], "MiCS", "drop mics_shard_size"),
        (
            ["+deepspeed.extra.expert_parallel.expert_tensor_parallel_size=2"],
            "expert_tensor_parallel_size=1",
            "parallel.ep_size",
        ),
        (
            ["+deepspeed.extra.zero_optimization.offload_optimizer={device: nvme, nvme_path: /tmp}"],
            "NVMe optimizer",
            "deepspeed=zero3_offload",
        ),
    ],
)
def test_zero3_ep_refusals_are_one_line_with_the_alternative(extra, needle, alternative):
    with pytest.raises(TrainConfigError) as e:
        validate(compose([*Z3EP, *extra]), 2)
    msg = str(e.value)
    assert needle in msg and alternative in msg and "parallel.ep_size=2" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "layout", [Z3EP, ["deepspeed=zero3_offload", "parallel.ep_size=2"], ["deepspeed=zero2", "parallel.ep_size=2"]]
)
def test_zero3_ep_and_offload_are_accepted(layout):
    assert validate(compose(layout), 2).num_experts == 8  # tiny preset


def test_the_same_keys_are_fine_without_expert_parallelism():
    cfg = compose(["deepspeed=zero3", "+deepspeed.extra.zero_optimization.zero_hpz_partition_size=2"])
    validate(cfg, 2)
    check_layout(3, 1, build_ds_config(cfg, 2))


def test_check_layout_reads_the_generated_deepspeed_json():
    ds = build_ds_config(compose(Z3EP), 2)
    check_layout(3, 2, ds)  # the generated JSON itself is fine
    with pytest.raises(LayoutError, match="MiCS"):
        check_layout(3, 2, {**ds, "zero_optimization": {**ds["zero_optimization"], "mics_shard_size": 4}})
