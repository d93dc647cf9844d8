"""LoRA in the planner (`finetune=lora`, docs/lora.md): the per-GPU memory terms of a frozen base + adapters.

What changes against full training (training/tools/plan.py `plan`, which calls `lora_terms` when the layout has a
LoRA spec):

* **weights**: the frozen base, partitioned as in full training (dense over the world under ZeRO-3, experts over
  EP and, under ZeRO-3, their expert-data-parallel group), in the parameters' dtype, except MXFP4 routed experts
  (`lora.base_experts=mxfp4`): 4.25 bits a weight (4-bit codes + one 8-bit scale per 32) and never partitioned
  by ZeRO-3 (they are buffers, model/moe/mxfp4_experts.py), so E/EP experts whole per rank; plus the adapters.
* **grads / optimizer / optimizer_step**: adapters only (the base has requires_grad=False and is in no optimizer
  group): fp32 master + two Adam moments, ZeRO-partitioned like any parameter.
* **zero3_gathered**: what ZeRO-3 holds gathered now excludes MXFP4 experts (not parameters).
* **lora_expert_transient**: one MoE layer's local experts made in the compute dtype while it runs (bf16 base:
  the merged W + s B A and its gradient; MXFP4: also the dequantised base), counted at every moment
  (conservative): 2 (bf16) or 3 (MXFP4) copies of one layer's local experts.

Adapter sizes come from the meta-device model with the adapters added (model/lora.py), so they are exact.
Not modelled: the smaller data-parallel gradient traffic (only adapters are reduced; plan.py's comm terms still
count every parameter), and LoRA with optimizer offload (its CPU terms are full training's).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

MXFP4_BITS = 4.25  # per routed-expert weight: a 4-bit E2M1 code + an 8-bit E8M0 scale per 32 weights
_TRANSIENT_COPIES = {"bf16": 2, "mxfp4": 3}


@functools.lru_cache(maxsize=8)
def _adapter_counts(config_json: str, spec) -> tuple[int, int]:
    from model import K3Config
    from model.lora import apply_lora, is_adapter_param
    from model.params import build_meta

    model = build_meta(K3Config.from_hf_config(json.loads(config_json)))
    apply_lora(model, spec)
    dense = expert = 0
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            if ".experts.lora." in f".{name}":
                expert += p.numel()
            else:
                dense += p.numel()
    return dense, expert


def adapter_counts(config, spec) -> dict[str, int]:
    """{'dense': adapters outside the routed experts, 'expert': the routed experts' (all experts)}."""
    dense, expert = _adapter_counts(json.dumps(config.to_hf_config(), sort_keys=True), spec)
    return {"dense": dense, "expert": expert}


def frozen_base_bytes(config, bd: dict[str, int], base_experts: str, weight_bytes: int) -> dict[str, float]:
    """Whole-model frozen base bytes: {'dense', 'expert'} (routed experts at 4.25 bits under mxfp4)."""
    n_expert = bd["moe_routed_experts"]
    expert = n_expert * MXFP4_BITS / 8 if base_experts == "mxfp4" else n_expert * weight_bytes
    return {"dense": (bd["total"] - n_expert) * weight_bytes, "expert": expert}


def lora_terms(
    config, bd: dict[str, int], layout: Any, world: int, per: dict[str, int], zero3_gathered_params: Callable
) -> dict[str, float]:
    """Per-GPU bytes replacing plan()'s weights/grads/optimizer(_step)/zero3_gathered for a LoRA run, plus the
    experts' transient (module docstring). `per`: plan.state_bytes_per_param of the layout; `zero3_gathered_params`:
    plan.py's (passed in: this module is imported by plan.py)."""
    spec, z, ep = layout.lora, layout.zero_stage, layout.ep_size
    dp_expert = world // ep
    mxfp4 = spec.base_experts == "mxfp4"
    ad = adapter_counts(config, spec)
    adapters = {"dense": ad["dense"], "expert": ad["expert"] / ep}

    def shard(n: dict[str, float], stage_min: int, experts_partitioned: bool = True) -> float:
        d = n["dense"] / (world if z >= stage_min else 1)
        return d + n["expert"] / (dp_expert if z >= stage_min and experts_partitioned else 1)

    base = frozen_base_bytes(config, bd, spec.base_experts, per["weights"])
    base_local = shard({"dense": base["dense"], "expert": base["expert"] / ep}, 3, experts_partitioned=not mxfp4)
    out = {
        "weights": base_local + shard(adapters, 3) * per["weights"],
        "grads": shard(adapters, 2) * per["grads"],
        "optimizer": shard(adapters, 1) * per["optimizer"],
    }
    n_moe = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    layer_experts = bd["moe_routed_experts"] / max(1, n_moe) / ep  # one layer's local experts, elements
    act_b = 2 if layout.precision == "bf16" else 4
    out["lora_expert_transient"] = _TRANSIENT_COPIES[spec.base_experts] * layer_experts * act_b
    if z == 3:
        n_dense = bd["total"] - bd["moe_routed_experts"]
        local_full = n_dense + (0 if mxfp4 else bd["moe_routed_experts"] / ep) + adapters["dense"] + adapters["expert"]
        gbd = dict(bd)
        if mxfp4:  # no expert weights in the gathered units
            gbd["moe_layer"] = bd["moe_layer"] - bd["per_routed_expert"] * config.num_experts // ep
        out["zero3_gathered"] = zero3_gathered_params(config, gbd, layout, local_full) * per["weights"]
        if not layout.offload_optimizer:
            out["optimizer_step"] = min(layout.sub_group_size, shard(adapters, 1)) * 4.0
    return out
