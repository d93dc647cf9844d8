"""DeepSpeed engine construction: JSON generated from the Hydra config, optimizer groups, LR schedule.

One source of truth: `build_ds_config` derives every DeepSpeed key from the typed config (batch arithmetic,
precision, clipping, ZeRO stage and offload) and deep-merges `deepspeed.extra` last, so any DeepSpeed key can be
set from the command line (`+deepspeed.extra.zero_optimization.reduce_bucket_size=1e6`). Nothing JIT-compiles
unless offload is requested: the optimizer is a client `torch.optim.AdamW` (or Muon, training/optim/muon.py) otherwise.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
from omegaconf import DictConfig
from torch import nn


def use_bf16(cfg: DictConfig) -> bool:
    """fp32 on CPU (exact resume), bf16 on GPU unless train.precision says otherwise."""
    if cfg.train.precision == "auto":
        return torch.cuda.is_available()
    return cfg.train.precision == "bf16"


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def build_ds_config(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON for this run (saved as <run_dir>/ds_config.json)."""
    from omegaconf import OmegaConf

    t, ds = cfg.train, cfg.deepspeed
    zero: dict[str, Any] = {"stage": int(ds.zero_stage)}
    if ds.zero_stage >= 1:
        zero.update(
            overlap_comm=bool(ds.overlap_comm),
            contiguous_gradients=True,
            reduce_bucket_size=int(ds.reduce_bucket_size),
            allgather_bucket_size=int(ds.reduce_bucket_size),
        )
    if ds.zero_stage == 3:
        zero["sub_group_size"] = int(ds.sub_group_size)
        if cfg.optim.name == "muon":  # stage3 refuses Muon with reduce-scatter: it needs whole gradients
            zero["reduce_scatter"] = False
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    bf16 = use_bf16(cfg)
    out: dict[str, Any] = {
        # no train_batch_size: DeepSpeed derives it (micro x GA x data-parallel size), so the saved JSON is valid
        # for any world size (engine._configure_train_batch_size / DeepSpeedConfig._batch_assertion)
        "train_micro_batch_size_per_gpu": int(t.micro_batch_size),
        "gradient_accumulation_steps": int(t.grad_accum),
        "gradient_clipping": float(t.grad_clip),
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,  # our own logger reports; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
        "dump_state": False,
    }
    if bf16:
        out["data_types"] = {"grad_accum_dtype": "fp32"}
    if int(cfg.parallel.sp_size) > 1:  # DeepSpeed's key; the groups come with the mpu (training/parallel/ulysses)
        out["sequence_parallel_size"] = int(cfg.parallel.sp_size)
    if ds.offload_optimizer or ds.offload_param:
        # offload needs DeepSpeed's own CPU Adam (DeepSpeed refuses a client optimizer with offload)
        out["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": float(cfg.optim.lr),
                "betas": [float(b) for b in cfg.optim.betas],
                "eps": float(cfg.optim.eps),
                "weight_decay": float(cfg.schedule.weight_decay),
            },
        }
    extra = OmegaConf.to_container(ds.extra, resolve=True) if isinstance(ds.extra, DictConfig) else dict(ds.extra)
    return deep_merge(out, extra or {})


def lr_lambda(cfg: DictConfig, total_steps: int | None = None) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step s (0-based): warmup, then cosine / wsd / constant over the
    horizon `total_steps` (default train.steps; a resumed run keeps its original one), its final value after."""
    steps, sch = int(total_steps if total_steps is not None else cfg.train.steps), cfg.schedule
    warm = max(1, int(math.ceil(sch.warmup_frac * steps))) if sch.warmup_frac > 0 else 0
    floor = float(sch.min_lr_ratio)
    decay_start = int(steps * (1 - sch.decay_frac))

    def fn(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        if sch.name == "constant":
            return 1.0
        if sch.name == "cosine":
            p = min(1.0, (s - warm) / max(1, steps - warm))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
        # wsd
        if s < decay_start:
            return 1.0
        p = min(1.0, (s - decay_start) / max(1, steps - decay_start))
        return 1.0 - (1.0 - floor) * p

    return fn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (dim >= 2), never 1-D params; names kept for Muon's routing."""
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # ds_shape: a ZeRO-3 parameter built sharded (training/parallel/construct.py) is a flat partition already
        (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def base_param_groups(cfg: DictConfig, model: nn.Module) -> list[dict[str, Any]]:
    """The optimizer's groups before any expert split: Muon's (training/optim/muon.py) or AdamW's."""
    wd = float(cfg.schedule.weight_decay)
    if cfg.optim.name == "muon":
        from training.optim.muon import muon_param_groups

        return muon_param_groups(model, wd, cfg)
    return param_groups(model, wd)


def build_optimizer(
    cfg: DictConfig, model: nn.Module, groups: list[dict[str, Any]] | None = None
) -> torch.optim.Optimizer | None:
    """Client optimizer, or None when DeepSpeed's offload optimizer is configured in the JSON."""
    if cfg.deepspeed.offload_optimizer or cfg.deepspeed.offload_param:
        return None
    wd = float(cfg.schedule.weight_decay)
    if cfg.optim.name == "muon":
        from training.optim.muon import Muon

        return Muon(
            groups if groups is not None else base_param_groups(cfg, model),
            ns_steps=int(cfg.optim.muon_ns_steps),
            scale=str(cfg.optim.muon_lr_scale),
        )
    groups = groups if groups is not None else param_groups(model, wd)
    # fused: one pass over each tensor (CPU and CUDA kernels), no temporaries; 6x the per-tensor loop on CPU
    return torch.optim.AdamW(
        groups,
        lr=float(cfg.optim.lr),
        betas=tuple(float(b) for b in cfg.optim.betas),
        eps=float(cfg.optim.eps),
        weight_decay=wd,
        fused=True,
    )


def initialize(
    cfg: DictConfig,
    model: nn.Module,
    ds_config: dict[str, Any],
    groups=None,
    total_steps: int | None = None,
    mpu: Any = None,
):
    """deepspeed.initialize with a client optimizer (or the JSON's for offload) and a LambdaLR schedule.
    The model must already be laid out (training/parallelize.py: experts, ZeRO-3 external params); `mpu`: the
    sequence-parallel groups (training/parallel/ulysses.py), None without sequence parallelism."""
    import deepspeed

    import training.optim.ds_muon  # noqa: F401 - before deepspeed.initialize imports it compiled (see the module)

    opt = build_optimizer(cfg, model, groups)
    fn = lr_lambda(cfg, total_steps)

    def sched(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

    kwargs: dict[str, Any] = dict(model=model, config=ds_config, lr_scheduler=sched, mpu=mpu)
    if opt is not None:
        kwargs["optimizer"] = opt
    else:
        kwargs["model_parameters"] = (
            groups if groups is not None else param_groups(model, float(cfg.schedule.weight_decay))
        )
    with autoep_sequence_parallel(cfg, ds_config):
        engine, optimizer, _, scheduler = deepspeed.initialize(**kwargs)
    keep_zero0_grad_norm(engine)
    share_zero3_master_weights(engine)
    return engine, optimizer, scheduler


def autoep_sequence_parallel(cfg: DictConfig, ds_config: dict[str, Any]):
    """ZeRO-3 + EP + SP: the scope in which DeepSpeed accepts AutoEP layers with sequence parallelism
    (training/parallel/autoep_sp.py); a no-op context for every other layout."""
    import contextlib

    zero3 = int((ds_config.get("zero_optimization") or {}).get("stage", 0)) == 3
    if zero3 and int(cfg.parallel.ep_size) > 1 and int(ds_config.get("sequence_parallel_size", 1) or 1) > 1:
        from training.parallel.autoep_sp import allow_sequence_parallel

        return allow_sequence_parallel()
    return contextlib.nullcontext()


def share_zero3_master_weights(engine) -> int:
    """ZeRO-3 keeps no second fp32 copy of weights that are fp32 already, as DeepSpeed means it to.

    stage3 `_create_fp32_partitions` uses the module's flat partition itself as the optimizer's master partition
    when their dtype and device agree and nothing is offloaded or swapped ("we don't need another copy of the
    weights", deepspeed PR 7651), but it compares a torch.device with the accelerator's device *name* (a str), which
    is never equal, so 0.19.8 clones every partition: fp32 training holds 5 copies of each parameter instead of 4
    (0.55 GB per rank on `small`, 2 ranks). This takes that branch after the fact: the clone is dropped, the
    module partition (`fp16_partitioned_groups_flat[i]`, a view of `lp_param_buffer`) becomes the master
    partition, with the `ds_id` and `requires_grad` stage3 gives it. The optimizer state is created lazily at the
    first step, keyed by the master partition, so nothing else refers to the clone; the step's copy of the master
    into the module partition (`_reassign_or_swap_out_partitioned_parameters`) becomes a copy onto itself and every
    value is what the clone would have held. Returns how many partitions are now shared."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() != 3 or opt.offload_optimizer or opt.swap_optimizer:
        return 0
    shared = 0
    for i, (master, module_part) in enumerate(zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat)):
        if module_part is None or master is module_part:
            continue
        if master.dtype != module_part.dtype or master.device != module_part.device or master in opt.optimizer.state:
            continue
        module_part.ds_id, module_part.requires_grad = master.ds_id, True
        opt.fp32_partitioned_groups_flat[i] = module_part
        shared += 1
    return shared


def keep_zero0_grad_norm(engine) -> None:
    """ZeRO-0 fp32: DeepSpeed clips with runtime/utils.clip_grad_norm_ (engine.clip_fp32_gradients), which sums
    per-tensor norms in fp32 (6e-6 relative off on the tiny model) and drops the norm. Without MoE layers the
    gradients are identical on every rank, so clip the same way (coef = max_norm / (norm + 1e-6), capped at 1)
    with the norm accumulated in ZeRO's own norm dtype (zero/utils.get_norm_dtype, fp64), as the ZeRO optimizers
    do, and keep it in engine._global_grad_norm, where they leave theirs: grad norms then agree across stages."""
    from deepspeed.runtime.utils import clip_grad_norm_
    from deepspeed.runtime.zero.utils import get_norm_dtype

    if engine.zero_optimization() or engine.gradient_clipping() <= 0.0:
        return
    max_norm = float(engine.gradient_clipping())

    def clip_fp32_gradients() -> None:
        params = [p for p in engine.module.parameters() if p.grad is not None]
        if engine.has_moe_layers:  # expert grads differ per rank: DeepSpeed's averaged norm, kept
            engine._global_grad_norm = float(clip_grad_norm_(params, max_norm, mpu=engine.mpu))
            return
        norm = torch.stack([p.grad.detach().to(get_norm_dtype()).norm() for p in params]).pow(2).sum().sqrt()
        engine._global_grad_norm = float(norm)
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for p in params:
                p.grad.mul_(coef)

    engine.clip_fp32_gradients = clip_fp32_gradients
