"""Planner vision terms (training/tools/vision_memory.py): the k3 preset's MoonViT-V2 tower + projector states and
FLOPs are the arithmetic of the release's shapes, for a known image count."""

from __future__ import annotations

import pytest

from training.tools.plan import from_overrides, main, plan

# 64 GPUs, ZeRO-3 bf16, 256 images of 448 x 448 px per global batch, GA 2
K3_VLM = ["model=k3", "deepspeed=zero3", "parallel.ep_size=64", "train.grad_accum=2", "plan.nodes=8"]
IMAGES = ["plan.images_per_step=256", "plan.image_side=448"]

# the release's shapes: patch 14, d 1024, qkv 1536, inner 4096, 27 blocks, 64 x 64 position table, merge 2 x 2,
# projector 4096 -> 4096 -> 7168
D, Q, I, P, L, TEXT = 1024, 1536, 4096, 14, 27, 7168
TOWER = 3 * P * P * D + 64 * 64 * D + L * (2 * D + D * 3 * Q + Q * D + 2 * D * I) + D
PROJECTOR = 4 * D * 4 * D + 4 * D * TEXT + TEXT
N = (448 // P) ** 2  # 1024 patches, 256 merged tokens
FWD = (
    2 * N * (3 * P * P * D + L * (3 * Q * D + Q * D + 2 * D * I))
    + L * 4 * N * N * Q
    + 2 * (N // 4) * (PROJECTOR - TEXT)
)


def _plan(extra):
    config, layout, hw, _, warnings = from_overrides([*K3_VLM, *extra])
    return plan(config, layout, hw, warnings=warnings)


def test_tower_states_are_the_release_shapes_partitioned_over_all_ranks():
    p = _plan([])
    assert (TOWER, PROJECTOR) == (401214464, 46144512)  # count_vision_params(K3Config.preset("k3"))
    assert p["vision"]["params"] == {"tower": TOWER, "projector": PROJECTOR}
    g = p["gpu_memory_gb"]  # bf16 ZeRO-3: weights 2, grads 4 (fp32 partition), optimizer 12 bytes, each / 64
    assert g["vision_weights"] * 1e9 == pytest.approx((TOWER + PROJECTOR) * 2 / 64)
    assert g["vision_grads"] * 1e9 == pytest.approx((TOWER + PROJECTOR) * 4 / 64)
    assert g["vision_optimizer"] * 1e9 == pytest.approx((TOWER + PROJECTOR) * 12 / 64)


def test_flops_of_a_known_image_count():
    base, p = _plan([]), _plan(IMAGES)
    v = p["vision"]
    assert v["images_per_gpu_step"] == 256 / 64
    assert v["flops_per_image_train"] == 3 * FWD
    hw_rate = base["hardware"]["peak_tflops"] * 1e12 * base["hardware"]["mfu"]
    assert p["time"]["compute_s"] - base["time"]["compute_s"] == pytest.approx(4 * 3 * FWD / hw_rate)


def test_images_on_a_text_model_are_one_line_errors(capsys):
    assert main(["model=k3", "model.vision_config=false", "plan.images_per_step=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "plan.images_per_step=8 needs a model with a vision tower" in err
