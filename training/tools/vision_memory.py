"""The planner's vision terms (training/tools/plan.py): MoonViT-V2 tower + projector memory and FLOPs per GPU.

Keys: `plan.images_per_step` (images in one global batch; 0 = none: the tower's states still count, its
activations and FLOPs do not) and `plan.image_side` (pixels per side of each, square, a multiple of 28 = patch 14 x
merge 2; 448 by default: 32 x 32 patches, 256 `<|media_pad|>` tokens).

- **States.** The tower and projector (`count_vision_params`) are dense data-parallel parameters: ZeRO partitions
  their weights (stage 3), gradients (2+) and optimizer state (1+) over all W ranks, as the text model's dense ones,
  at the same bytes per parameter (plan.state_bytes_per_param).
- **Where images are computed.** A data-parallel rank runs the tower on its rows' images; under sequence
  parallelism every rank of an SP group runs it on all the group's images (features before the sequence split,
  docs/sequence_parallel.md). Images per GPU per step: images_per_step x sp / W; per micro-batch: that / GA.
- **Activations** (flash attention, the tower is never checkpointed), per patch and block: the block input, the
  norm0 output, q, k, v, rotated q and k, the attention output, the residual, the norm1 output, fc0's output and
  the GELU's: 4 d + 6 q + 2 i elements (d = vt_hidden_size, q = qkv_hidden_size, i = vt_intermediate_size); plus
  the patch pixels (3 p^2) and the embedding (d) per patch, and per merged token the projector's input, hidden and
  GELU (3 x 4 d). One micro-batch's images in the activation dtype.
- **FLOPs** (training = 3 x forward, the trainer's convention): per patch 2 x (3 p^2 d + L (3 q d + q d + 2 d i))
  matmul FLOPs, plus per image and block 4 n^2 q for the bidirectional attention over its n patches, plus per merged
  token 2 (4d x 4d + 4d x text_d) for the projector.
"""

from __future__ import annotations

from typing import Any

DEFAULT_SIDE = 448


def tower_forward_flops(v, patches: int) -> float:
    """Forward FLOPs of the tower + projector on one image of `patches` patches (a square grid)."""
    d, q, i, p, L = v.vt_hidden_size, v.qkv_hidden_size, v.vt_intermediate_size, v.patch_size, v.vt_num_hidden_layers
    matmul = 2 * patches * (3 * p * p * d + L * (3 * q * d + q * d + 2 * d * i))
    attention = L * 4 * patches * patches * q
    merged = patches // (v.merge_kernel_size[0] * v.merge_kernel_size[1])
    projector = 2 * merged * (v.merged_dim * v.merged_dim + v.merged_dim * v.text_hidden_size)
    return float(matmul + attention + projector)


def vision_terms(config, layout, world: int, per: dict[str, int]) -> dict[str, Any]:
    """{"gpu": memory terms in bytes, "flops_per_gpu_step", and the numbers behind them}; empty terms for a text
    model. `per`: bytes per parameter of weights / grads / optimizer (plan.state_bytes_per_param)."""
    v, n_img = config.vision_config, int(layout.images_per_step)
    if v is None:
        if n_img:
            raise ValueError(f"plan.images_per_step={n_img} needs a model with a vision tower (model.vision_config)")
        return {"gpu": {}, "flops_per_gpu_step": 0.0}
    side, unit = int(layout.image_side), v.patch_size * v.merge_kernel_size[0]
    if n_img < 0 or side < unit or side % unit:
        raise ValueError(f"plan.images_per_step must be >= 0 and plan.image_side a multiple of {unit}: {n_img}, {side}")
    from model import count_vision_params

    tower, projector = count_vision_params(config)
    n, z = tower + projector, layout.zero_stage
    gpu = {
        "vision_weights": n / (world if z >= 3 else 1) * per["weights"],
        "vision_grads": n / (world if z >= 2 else 1) * per["grads"],
        "vision_optimizer": n / (world if z >= 1 else 1) * per["optimizer"],
    }
    patches = (side // v.patch_size) ** 2
    images_gpu = n_img * layout.sp_size / world  # images this GPU's tower runs on per step
    images_micro = images_gpu / max(1, layout.grad_accum)
    d, q, i, p = v.vt_hidden_size, v.qkv_hidden_size, v.vt_intermediate_size, v.patch_size
    per_patch = v.vt_num_hidden_layers * (4 * d + 6 * q + 2 * i) + 3 * p * p + d
    per_merged = 3 * v.merged_dim
    merged = patches // (v.merge_kernel_size[0] * v.merge_kernel_size[1])
    act_b = 2 if layout.precision == "bf16" else 4
    gpu["vision_activations"] = images_micro * (patches * per_patch + merged * per_merged) * act_b
    flops_image = 3 * tower_forward_flops(v, patches)
    return {
        "gpu": gpu,
        "flops_per_gpu_step": images_gpu * flops_image,
        "params": {"tower": tower, "projector": projector},
        "patches_per_image": patches,
        "tokens_per_image": merged,
        "images_per_gpu_step": images_gpu,
        "flops_per_image_train": flops_image,
    }
