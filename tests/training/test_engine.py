"""DeepSpeed JSON generation, LR schedules and optimizer parameter groups."""

from __future__ import annotations

import pytest
from torch import nn

from training.config import compose
from training.engine import build_ds_config, lr_lambda, param_groups


def test_ds_json_batch_arithmetic_precision_clipping_and_zero():
    cfg = compose(
        [
            "train.micro_batch_size=3",
            "train.grad_accum=4",
            "train.grad_clip=0.5",
            "deepspeed=zero1",
            "train.precision=fp32",
        ]
    )
    ds = build_ds_config(cfg, world_size=2)
    assert "train_batch_size" not in ds  # DeepSpeed derives it: the JSON is valid for any world size
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 1
    assert ds["bf16"]["enabled"] is False and "optimizer" not in ds  # client AdamW: nothing compiles


def test_ds_json_bf16_when_asked():
    ds = build_ds_config(compose(["train.precision=bf16"]), world_size=1)
    assert ds["bf16"]["enabled"] is True


def test_ds_json_offload_uses_deepspeed_optimizer():
    ds = build_ds_config(compose(["deepspeed=zero3_offload"]), world_size=1)
    z = ds["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu" and z["offload_param"]["device"] == "cpu"
    assert ds["optimizer"]["type"] == "AdamW"


def test_zero3_json_bounds_the_optimizer_sub_group():
    # stage3 flattens one sub-group's gradients at a time in its step: the trainer's default keeps that at 80 MB
    z3 = build_ds_config(compose(["deepspeed=zero3"]), world_size=1)["zero_optimization"]
    assert z3["sub_group_size"] == 20_000_000
    z3 = build_ds_config(compose(["deepspeed=zero3", "deepspeed.sub_group_size=1000"]), world_size=1)
    assert z3["zero_optimization"]["sub_group_size"] == 1000
    assert "sub_group_size" not in build_ds_config(compose(["deepspeed=zero2"]), world_size=1)["zero_optimization"]


def test_any_deepspeed_key_overridable_from_the_command_line():
    cfg = compose(
        [
            "deepspeed=zero2",
            "+deepspeed.extra.zero_optimization.reduce_bucket_size=1000",
            "+deepspeed.extra.steps_per_print=7",
            "+deepspeed.extra.gradient_clipping=2.0",
        ]
    )
    ds = build_ds_config(cfg, world_size=1)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["zero_optimization"]["stage"] == 2  # deep merge keeps the siblings
    assert ds["steps_per_print"] == 7 and ds["gradient_clipping"] == 2.0


def test_cosine_schedule_warmup_one_percent_then_decay_to_floor():
    cfg = compose(["schedule=cosine", "train.steps=1000", "schedule.min_lr_ratio=0.1"])
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)  # 10 warmup steps = 1%
    assert f(10) == pytest.approx(1.0)
    assert f(505) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)
    assert f(1000) == pytest.approx(0.1)
    assert cfg.schedule.weight_decay == 0.1


def test_wsd_schedule_is_flat_then_linear_decay():
    cfg = compose(["schedule=wsd", "train.steps=100", "schedule.decay_frac=0.2", "schedule.min_lr_ratio=0.0"])
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(1.0) and f(50) == 1.0 and f(79) == 1.0
    assert f(90) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)
    assert all(f(s) >= f(s + 1) for s in range(1, 100))


def test_param_groups_decay_matrices_only():
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    groups = param_groups(m, 0.1)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(m[0].weight)}
    assert sum(len(g["params"]) for g in groups) == 4
