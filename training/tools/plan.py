"""Planner: will a layout fit, and how fast will it run? `python -m training.plan <hydra overrides> [plan.*=...]`.

Composes the same Hydra config as training (model, deepspeed, parallel, train groups and keys), adds hardware
assumptions under `plan.*` (nodes, gpus_per_node, gpu_memory_gb, cpu_memory_gb, peak_tflops, mfu, net_gbps,
nvlink_gbps, a2a_overlap, dp_overlap, reserve_gb, attention, out, format) and prints a table (and JSON) of:
parameters per GPU (dense vs expert shares), gradient and optimizer-state memory under the ZeRO stage and
offload, activation memory of one micro-batch (training/tools/activation_memory.py), total vs GPU memory, FLOPs per
token (training.metrics.flops, the trainer's MFU formula), all-to-all bytes per step per GPU, step time and tokens/s.
Memory is in GB (1e9 bytes). Formulas and a worked K3 example: docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.config import DeepSpeedSection
from training.metrics.flops import flops_per_token
from training.metrics.system import GPU_PEAK_BF16
from training.tools.activation_memory import activation_bytes, loss_backward_bytes
from training.tools.lora_memory import lora_terms
from training.tools.plan_export import export_plan
from training.tools.plan_table import format_table
from training.tools.vision_memory import DEFAULT_SIDE, vision_terms

GB = 1e9
ZERO0_ALLREDUCE_ELEMENTS = 500_000_000  # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE (0.19.8)


@dataclass
class Hardware:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gb: float = 141.0  # H200
    cpu_memory_gb: float = 2048.0  # per node, for offloaded states
    peak_tflops: float = GPU_PEAK_BF16["H200"] / 1e12  # dense bf16
    mfu: float = 0.4  # assumed model FLOPs utilisation of the compute
    net_gbps: float = 400.0  # inter-node bandwidth per GPU, Gbit/s (one 400G NIC per GPU)
    nvlink_gbps: float = 3600.0  # intra-node bandwidth per GPU per direction, Gbit/s (450 GB/s)
    a2a_overlap: float = 0.0  # fraction of MoE all-to-all hidden behind compute
    dp_overlap: float = 0.8  # fraction of gradient reduction hidden behind backward
    reserve_gb: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    attention: str = "flash"  # flash (fused kernels; also CPU training) | math (SDPA math path keeps T x T probs)
    disk_gbps: float = 2.0  # checkpoint/export storage, GB/s read + write per node (training/tools/plan_export.py)
    export_procs: int = 8  # export processes per node (training.export --procs)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Layout:
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    ep_size: int = 1
    sp_size: int = 1  # Ulysses sequence parallelism: ranks sharing (and splitting) each sequence
    micro_batch_size: int = 1
    seq_len: int = 4096
    grad_accum: int = 1
    activation_checkpointing: bool = False
    activation_offload: bool = False  # checkpointed layer inputs in host memory (model/offload.py)
    loss_tile_tokens: int = 0  # tiled logits + CE (model/loss.py)
    ffn_tile_tokens: int = 0  # dense FFN / shared experts over sequence tiles (model/ffn.py)
    mixer_tile_tokens: int = 0  # KDA core over recomputed tiles (model/kda/tiled.py)
    precision: str = "bf16"  # bf16 | fp32
    reduce_bucket_size: int = DeepSpeedSection.reduce_bucket_size
    overlap_comm: bool = False
    sub_group_size: int = DeepSpeedSection.sub_group_size
    # ZeRO-3 gathering knobs (DeepSpeed JSON zero_optimization stage3_*); None: DeepSpeed's own default
    max_live_parameters: int | None = None
    max_reuse_distance: int | None = None
    prefetch_bucket_size: int | None = None
    lora: Any = None  # finetune=lora: model.lora.LoRASpec (training/tools/lora_memory.py)
    images_per_step: int = 0  # plan.images_per_step / plan.image_side: the vision tower (training/tools/vision_memory)
    image_side: int = DEFAULT_SIDE


def zero3_knobs_from_json(ds_config: dict[str, Any]) -> dict[str, int]:
    """Layout's ZeRO-3 fields that the DeepSpeed JSON sets (training/engine.py build_ds_config, `deepspeed.extra`
    merged), read under DeepSpeed's key names; the others keep Layout's defaults."""
    z = ds_config.get("zero_optimization", {}) or {}
    keys = {f"stage3_{k}": k for k in ("max_live_parameters", "max_reuse_distance", "prefetch_bucket_size")}
    keys["sub_group_size"] = "sub_group_size"
    return {field_: int(z[key]) for key, field_ in keys.items() if key in z}


def zero3_gather_knobs(layout: Layout) -> tuple[int, int, int]:
    """(max_live_parameters, max_reuse_distance, prefetch_bucket_size) as DeepSpeed reads them: unset ones take
    the defaults of its own config model (runtime/zero/config.py DeepSpeedZeroConfig), so they have one home."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    d = DeepSpeedZeroConfig(stage=3)
    pick = (
        (layout.max_live_parameters, d.max_live_parameters),
        (layout.max_reuse_distance, d.max_reuse_distance),
        (layout.prefetch_bucket_size, d.prefetch_bucket_size),
    )
    return tuple(int(v if v is not None else default) for v, default in pick)  # type: ignore[return-value]


def state_bytes_per_param(precision: str, zero_stage: int = 0, offload_optimizer: bool = False) -> dict[str, int]:
    """Bytes per parameter of weights, gradients and optimizer state.

    bf16 (ZeRO paper): weights 2 + grads 2 + fp32 master, m, v 12; ZeRO-3 keeps its gradient partition in
    `data_types.grad_accum_dtype`, fp32 in the trainer's JSON (stage3 `grad_partitions_flat_buffer`): grads 4.
    fp32: 4 + 4 + m, v 8. ZeRO-1/2 add their own fp32 master partition (stage_1_and_2 clones fp32 weights too):
    optimizer 12. fp32 ZeRO-3 updates the module partition itself (the trainer applies stage3's "no second copy"
    branch, training/engine.py `share_zero3_master_weights`): 8, unless the optimizer is offloaded and its master
    lives beside the CPU optimizer: 12."""
    if precision == "bf16":  # ZeRO-3 accumulates into an fp32 partition: the trainer's grad_accum_dtype fp32
        return {"weights": 2, "grads": 4 if zero_stage == 3 else 2, "optimizer": 12}
    separate_master = zero_stage in (1, 2) or (zero_stage == 3 and offload_optimizer)
    return {"weights": 4, "grads": 4, "optimizer": 12 if separate_master else 8}


def grads_persist(layout: Layout) -> bool:
    """Whether gradient memory is held through the whole backward. DeepSpeed's ZeRO (stage >= 1) and bf16 optimizers
    keep flat gradient buffers from step to step; plain fp32 ZeRO-0 creates each gradient during backward (the
    optimizer zeroes them with set_to_none), so early in backward they are not there yet."""
    return layout.zero_stage >= 1 or layout.precision == "bf16"


# alive from the forward into the backward
BACKWARD_TERMS = ("activations", "loss_backward", "zero3_gathered", "vision_activations")
STEP_TERMS = ("optimizer_step",)  # alive during the optimizer step only


def peak_bytes(gpu: dict[str, float], grads_persist: bool) -> float:
    """Peak of one train step from the memory terms. Backward frees activations layer by layer while it creates
    gradients, so the two coexist in full only when gradients persist; otherwise the peak is the larger end of the
    backward: its start (every activation, gathered weight and the loss backward's transient) or its end (every
    gradient). The optimizer step comes after the backward has freed all that, with its own transient."""
    static = sum(v for k, v in gpu.items() if k not in ("grads", *BACKWARD_TERMS, *STEP_TERMS))
    start = sum(gpu.get(k, 0.0) for k in BACKWARD_TERMS)
    step = sum(gpu.get(k, 0.0) for k in STEP_TERMS)
    if grads_persist:
        return static + gpu["grads"] + max(start, step)
    return static + max(start, gpu["grads"] + step)


def sp_all_to_all_bytes(config, tokens_local: float, sp: int, act_b: int, passes: int) -> float:
    """Bytes one rank sends per step in Ulysses' head all-to-alls (model/sequence.py), (sp-1)/sp of each exchange
    leaving the rank. Per local token and layer, forward: KDA q, k, v before the conv (activation dtype), its fp32
    decay g and beta, the fp32 core output; MLA the query heads, its output heads and the latent [c_hat ; k_r]
    sent whole to each of the sp-1 others. Backward sends the same bytes back; `passes` = 2 (+1 checkpointing)."""
    if sp <= 1:
        return 0.0
    P, H = config.kda_num_heads * config.kda_head_dim, config.kda_num_heads
    kda = 3 * P * act_b + (P + H) * 4 + P * 4
    Hm = config.num_attention_heads
    q = Hm * (config.qk_nope_head_dim + config.qk_rope_head_dim) * act_b
    mla_heads = q + Hm * config.v_head_dim * act_b
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * act_b
    n_kda = sum(t == "kda" for t in config.layer_types)
    n_mla = config.num_hidden_layers - n_kda
    frac = (sp - 1) / sp
    per_token = n_kda * kda * frac + n_mla * (mla_heads * frac + latent * (sp - 1))
    return tokens_local * per_token * passes


def _largest_unit(config, bd: dict[str, int], ep: int) -> int:
    """Largest set of parameters ZeRO-3 gathers at once (a decoder layer's local share, embedding or head)."""
    V, d = config.vocab_size, config.hidden_size
    mixer = max(bd.get("kda_layer", 0), bd.get("mla_layer", 0))
    moe = bd.get("moe_layer", 0) - bd.get("per_routed_expert", 0) * config.num_experts * (1 - 1 / ep)
    return int(max(V * d, mixer + max(moe, bd.get("dense_ffn_layer", 0))))


def zero3_gathered_params(config, bd: dict[str, int], layout: Layout, local_full: float) -> float:
    """Parameters ZeRO-3 holds gathered at the start of backward (the peak), in elements. DeepSpeed's coordinator
    keeps a released module's parameters when they are used again within `max_reuse_distance` elements of the
    trace, and its prefetcher (when `prefetch_bucket_size` > 0) keeps the gathered parameters it walks past, up to
    `max_live_parameters` (partitioned_param_coordinator `__params_to_release`, `fetch_sub_module`): at most the
    larger of the two plus the unit being computed, never more than the whole model as this rank sees it
    (`local_full`: dense tensors whole, its experts whole). Measured on 2 CPU ranks (`small`, 0.81 GB): DeepSpeed's
    defaults (1e9, 1e9, 5e7) keep all of it gathered, as planned; live = reuse = 5e7 keep 0.21 GB (planned 0.30);
    reuse = prefetch = 0 keep none beyond the unit in use (planned: that unit, 0.10 GB)."""
    live, reuse, prefetch = zero3_gather_knobs(layout)
    kept = max(reuse, live if prefetch > 0 else 0)
    return min(local_full, kept + _largest_unit(config, bd, layout.ep_size))


def plan(
    config, layout: Layout, hw: Hardware, breakdown: dict[str, int] | None = None, warnings: Sequence[str] = ()
) -> dict[str, Any]:
    """The full plan as a JSON-able dict (bytes in GB, times in s). `breakdown` = model.params.param_breakdown."""
    if breakdown is None:
        from model.params import param_breakdown

        breakdown = param_breakdown(config)
    bd = breakdown
    W, ep, z, sp = hw.world, layout.ep_size, layout.zero_stage, layout.sp_size
    if W % ep or config.num_experts % ep:
        raise ValueError(f"parallel.ep_size={ep} must divide the world size {W} and num_experts={config.num_experts}")
    if W % sp or layout.seq_len % sp:
        raise ValueError(f"parallel.sp_size={sp} must divide the world size {W} and seq_len={layout.seq_len}")
    n_expert = bd["moe_routed_experts"]
    n_dense = bd["total"] - n_expert
    dp_dense, dp_expert = W, W // ep  # data-parallel group of dense params; of each expert shard
    per = state_bytes_per_param(layout.precision, z, layout.offload_optimizer)
    params = {"dense": n_dense, "expert": n_expert / ep}

    def shard(stage_min: int) -> float:
        """Local count of a state kind that ZeRO partitions over its DP group from stage `stage_min` on."""
        return params["dense"] / (dp_dense if z >= stage_min else 1) + params["expert"] / (
            dp_expert if z >= stage_min else 1
        )

    w_local, g_local, o_local = shard(3), shard(2), shard(1)
    # ZeRO-3 with an offloaded optimizer keeps its gradient partition on the CPU too (stage3 `self.device`)
    grads_on_cpu = z == 3 and layout.offload_optimizer
    gpu = {
        "weights": 0.0 if layout.offload_param else w_local * per["weights"],
        "grads": 0.0 if grads_on_cpu else g_local * per["grads"],
        "optimizer": 0.0 if layout.offload_optimizer else o_local * per["optimizer"],
    }
    # ZeRO-Offload also keeps an fp32 gradient partition beside the CPU optimizer (measured: bench/memory_dist.py)
    cpu_per_gpu = (
        (o_local * (per["optimizer"] + 4) if layout.offload_optimizer else 0.0)
        + (w_local * per["weights"] if layout.offload_param else 0.0)
        + (g_local * per["grads"] if grads_on_cpu else 0.0)
    )
    if z == 3:  # gathered full tensors held at the peak (zero3_gathered_params)
        local_full = params["dense"] + params["expert"]
        gpu["zero3_gathered"] = zero3_gathered_params(config, bd, layout, local_full) * per["weights"]
        if not layout.offload_optimizer:  # the step flattens one sub-group's gradients at a time, in fp32
            gpu["optimizer_step"] = min(layout.sub_group_size, o_local) * 4.0
    # ZeRO-3 reduces through one bucket unless overlap_comm double-buffers it (measured: bench/memory_dist.py); a
    # bucket holds gradients in the parameters' dtype
    n_buckets = 1.0 if z == 3 and not layout.overlap_comm else 2.0
    gpu["comm_buckets"] = n_buckets * layout.reduce_bucket_size * per["weights"]
    if z == 0:  # no ZeRO buckets: engine.allreduce_gradients flattens at most MEMORY_OPT_ALLREDUCE_SIZE grads at once
        gpu["comm_buckets"] = min(g_local, ZERO0_ALLREDUCE_ELEMENTS) * per["grads"] if W > 1 else 0.0
    act_b = 2 if layout.precision == "bf16" else 4
    mb, T, tiles = layout.micro_batch_size, layout.seq_len, (layout.ffn_tile_tokens, layout.loss_tile_tokens)
    ckpt, off, mixer = layout.activation_checkpointing, layout.activation_offload, layout.mixer_tile_tokens
    acts = activation_bytes(config, mb, T, act_b, ckpt, hw.attention, sp, *tiles, off, mixer_tile=mixer)
    gpu["activations"] = acts["total"]
    cpu_per_gpu += acts.get("host_layer_inputs", 0.0)
    gpu["loss_backward"] = loss_backward_bytes(config, mb, T, act_b, sp, layout.loss_tile_tokens)
    gpu["reserve"] = hw.reserve_gb * GB
    if layout.lora is not None:  # frozen base + adapter state (training/tools/lora_memory.py)
        gpu.update(lora_terms(config, bd, layout, W, per, zero3_gathered_params))
    vision = vision_terms(config, layout, W, per)
    gpu.update(vision.pop("gpu"))
    gpu_total = peak_bytes(gpu, grads_persist=grads_persist(layout))

    # compute
    fpt = flops_per_token(config, layout.seq_len, training=True)
    tokens_gpu = layout.micro_batch_size * layout.seq_len * layout.grad_accum // sp  # this rank's share
    compute_s = (tokens_gpu * fpt + vision["flops_per_gpu_step"]) / (hw.peak_tflops * 1e12 * hw.mfu)

    # MoE all-to-all: every (token, expert) pair carries l values in the activation dtype, out and back, in forward
    # and backward (+ forward again when checkpointing); the share for experts on other GPUs leaves this GPU.
    n_moe = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    passes = 4 + (2 if layout.activation_checkpointing else 0)
    pair_bytes = config.num_experts_per_token * config.routed_expert_hidden_size * act_b
    a2a = tokens_gpu * pair_bytes * passes * n_moe * (ep - 1) / ep
    in_node = min(ep, hw.gpus_per_node)
    a2a_intra = a2a * ((in_node - 1) / (ep - 1) if ep > 1 else 0.0)
    a2a_inter = a2a - a2a_intra
    a2a_s = max(a2a_inter * 8 / (hw.net_gbps * 1e9), a2a_intra * 8 / (hw.nvlink_gbps * 1e9))
    # Ulysses: a sequence-parallel group is sp consecutive ranks, inside a node when sp <= gpus_per_node
    sp_a2a = sp_all_to_all_bytes(config, tokens_gpu, sp, act_b, 2 + (1 if layout.activation_checkpointing else 0))
    sp_bw = hw.nvlink_gbps if sp <= hw.gpus_per_node else hw.net_gbps
    sp_s = sp_a2a * 8 / (sp_bw * 1e9)

    # data-parallel gradient traffic: ring reduce-scatter + all-gather = 2 (g-1)/g of the bytes (ZeRO-3: 3)
    factor = 3.0 if z == 3 else 2.0
    # gradients travel in the parameters' dtype (DeepSpeed's communication_data_type), whatever they accumulate in
    wire = per["weights"]
    dp_dense_b = factor * (dp_dense - 1) / dp_dense * params["dense"] * wire
    dp_exp_b = factor * (dp_expert - 1) / dp_expert * params["expert"] * wire if dp_expert > 1 else 0.0
    # a ring over a group spanning nodes runs at the network's rate: the dense group, and an expert-data group
    bw = hw.net_gbps if hw.nodes > 1 else hw.nvlink_gbps
    dp_s = (dp_dense_b + dp_exp_b) * 8 / (bw * 1e9)
    step_s = compute_s + (1 - hw.a2a_overlap) * a2a_s + sp_s + (1 - hw.dp_overlap) * dp_s
    tokens_step = tokens_gpu * W

    return {
        "model": {
            "total_params": bd["total"],
            "active_params": bd["active"],
            "expert_params": n_expert,
            "dense_params": n_dense,
            "flops_per_token_train": fpt,
        },
        "layout": dataclasses.asdict(layout),
        "hardware": {**dataclasses.asdict(hw), "world": W},
        "params_per_gpu": {
            "dense": params["dense"] / (dp_dense if z >= 3 else 1),
            "expert": params["expert"] / (dp_expert if z >= 3 else 1),
            "dense_full": params["dense"],
            "expert_full": params["expert"],
        },
        "gpu_memory_gb": {k: v / GB for k, v in gpu.items()} | {"total": gpu_total / GB},
        "activations_gb": {k: v / GB for k, v in acts.items()},
        "cpu_memory_gb_per_node": cpu_per_gpu * hw.gpus_per_node / GB,
        "fits": {
            "gpu": gpu_total <= hw.gpu_memory_gb * GB,
            "gpu_headroom_gb": hw.gpu_memory_gb - gpu_total / GB,
            "cpu": cpu_per_gpu * hw.gpus_per_node <= hw.cpu_memory_gb * GB,
            "cpu_headroom_gb": hw.cpu_memory_gb - cpu_per_gpu * hw.gpus_per_node / GB,
        },
        "comm_per_step_per_gpu_gb": {
            "moe_all_to_all": a2a / GB,
            "moe_all_to_all_inter_node": a2a_inter / GB,
            "dp_gradients": (dp_dense_b + dp_exp_b) / GB,
            "sp_all_to_all": sp_a2a / GB,
            "sp_all_to_all_per_layer": sp_a2a / max(1, config.num_hidden_layers) / GB,
        },
        "vision": vision,
        "export": export_plan(config, bd, hw.nodes, hw.export_procs, hw.disk_gbps, z),
        "warnings": list(warnings),
        "peak_rule": {
            "backward": [k for k in BACKWARD_TERMS if k in gpu],
            "step": [k for k in STEP_TERMS if k in gpu],
            "grads_persist": grads_persist(layout),
        },
        "time": {
            "compute_s": compute_s,
            "all_to_all_s": a2a_s,
            "sp_all_to_all_s": sp_s,
            "dp_comm_s": dp_s,
            "step_s": step_s,
            "tokens_per_step": tokens_step,
            "tokens_per_s": tokens_step / step_s,
            "tokens_per_s_per_gpu": tokens_gpu / step_s,
        },
    }


_PLAN_FIELDS = {f.name: f.type for f in dataclasses.fields(Hardware)} | {"out": "str", "format": "str", "device": "str"}
_PLAN_FIELDS |= {"images_per_step": "int", "image_side": "int"}  # Layout's


def split_overrides(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(hydra overrides, plan.* settings)."""
    hydra, planner = [], {}
    for arg in argv:
        key = arg.lstrip("+")
        if key.startswith("plan."):
            if "=" not in key:
                raise ValueError(f"{arg!r} needs a value: plan.<key>=<value>")
            k, v = key[len("plan.") :].split("=", 1)
            if k not in _PLAN_FIELDS:
                raise ValueError(f"unknown planner key plan.{k}; choose from {sorted(_PLAN_FIELDS)}")
            planner[k] = v
        else:
            hydra.append(arg)
    return hydra, planner


def from_overrides(argv: Sequence[str]) -> tuple[Any, Layout, Hardware, dict[str, str], list[str]]:
    """Compose conf/train.yaml with the overrides -> (K3Config, Layout, Hardware, extra settings, warnings).

    The trainer's cross-key validation runs for the planned world size; what it refuses (e.g. ZeRO-3 with expert
    parallelism) is still planned, with the refusal as a warning, so hypothetical layouts can be compared."""
    from training.config import TrainConfigError, build_model_config, compose, validate
    from training.engine import build_ds_config
    from training.lora import lora_spec

    hydra, planner = split_overrides(argv)
    cfg = compose(hydra)
    config = build_model_config(cfg)
    hw_kw: dict[str, Any] = {}
    for k, v in planner.items():
        if k in ("out", "format", "device", "images_per_step", "image_side"):
            continue
        ftype = type(getattr(Hardware(), k))
        hw_kw[k] = ftype(v)
    hw = Hardware(**hw_kw)
    device = planner.get("device", "gpu")
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device == "gpu" else "fp32"
    layout = Layout(
        zero_stage=int(cfg.deepspeed.zero_stage),
        offload_optimizer=bool(cfg.deepspeed.offload_optimizer),
        offload_param=bool(cfg.deepspeed.offload_param),
        ep_size=int(cfg.parallel.ep_size),
        sp_size=int(cfg.parallel.sp_size),
        micro_batch_size=int(cfg.train.micro_batch_size),
        seq_len=int(cfg.train.seq_len),
        grad_accum=int(cfg.train.grad_accum),
        activation_checkpointing=bool(cfg.train.activation_checkpointing),
        activation_offload=bool(cfg.train.activation_offload),
        loss_tile_tokens=int(cfg.train.loss_tile_tokens),
        ffn_tile_tokens=int(cfg.train.ffn_tile_tokens),
        mixer_tile_tokens=int(cfg.train.mixer_tile_tokens),
        precision=precision,
        reduce_bucket_size=int(cfg.deepspeed.reduce_bucket_size),
        overlap_comm=bool(cfg.deepspeed.overlap_comm),
        **zero3_knobs_from_json(build_ds_config(cfg, hw.world)),
        lora=lora_spec(cfg),
        **{k: int(planner[k]) for k in ("images_per_step", "image_side") if k in planner},
    )
    warnings = []
    try:
        validate(cfg, hw.world)
    except TrainConfigError as e:
        warnings.append(f"training would refuse this layout: {e}")
    return config, layout, hw, planner, warnings


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        config, layout, hw, extra, warnings = from_overrides(argv)
        result = plan(config, layout, hw, warnings=warnings)
    except Exception as e:  # noqa: BLE001 - every bad input becomes one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    if extra.get("format") == "json":
        print(json.dumps(result, indent=1))
    else:
        print(format_table(result))
    if extra.get("out"):
        with open(extra["out"], "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
