"""DeepSpeed engine construction: JSON generated from the Hydra config, optimizer groups, LR schedule.

One source of truth: `build_ds_config` derives every DeepSpeed key from the typed config (batch arithmetic,
precision, clipping, ZeRO stage and offload) and deep-merges `deepspeed.extra` last, so any DeepSpeed key can be
set from the command line (`+deepspeed.extra.zero_optimization.reduce_bucket_size=1e6`). Nothing JIT-compiles
unless offload is requested: the optimizer is a client `torch.optim.AdamW` (or Muon) otherwise.
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
        zero.update(overlap_comm=bool(ds.overlap_comm), contiguous_gradients=True,
                    reduce_bucket_size=int(ds.reduce_bucket_size), allgather_bucket_size=int(ds.reduce_bucket_size))
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
    if ds.offload_optimizer or ds.offload_param:
        # offload needs DeepSpeed's own CPU Adam (DeepSpeed refuses a client optimizer with offload)
        out["optimizer"] = {"type": "AdamW", "params": {
            "lr": float(cfg.optim.lr), "betas": [float(b) for b in cfg.optim.betas], "eps": float(cfg.optim.eps),
            "weight_decay": float(cfg.schedule.weight_decay)}}
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
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def build_optimizer(cfg: DictConfig, model: nn.Module, groups: list[dict[str, Any]] | None = None
                    ) -> torch.optim.Optimizer | None:
    """Client optimizer, or None when DeepSpeed's offload optimizer is configured in the JSON."""
    if cfg.deepspeed.offload_optimizer or cfg.deepspeed.offload_param:
        return None
    wd = float(cfg.schedule.weight_decay)
    if cfg.optim.name == "muon":
        from training.optim.muon import Muon, muon_param_groups
        return Muon(muon_param_groups(model, wd, cfg), lr=float(cfg.optim.lr), betas=tuple(cfg.optim.betas),
                    eps=float(cfg.optim.eps), momentum=float(cfg.optim.muon_momentum),
                    ns_steps=int(cfg.optim.muon_ns_steps))
    groups = groups if groups is not None else param_groups(model, wd)
    # fused: one pass over each tensor (CPU and CUDA kernels), no temporaries; 6x the per-tensor loop on CPU
    return torch.optim.AdamW(groups, lr=float(cfg.optim.lr), betas=tuple(float(b) for b in cfg.optim.betas),
                             eps=float(cfg.optim.eps), weight_decay=wd, fused=True)


def _has_hookable_tensor(value: Any) -> bool:
    """Whether DeepSpeed's module hooks can see a tensor in this output (tensors in tuples/lists/dicts only)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_hookable_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_hookable_tensor(v) for v in value.values())
    return False


@torch.no_grad()
def register_external_params_for_zero3(model: nn.Module, vocab_size: int) -> int:
    """Make ZeRO-3 gather every parameter where it is used.

    ZeRO-3 gathers a module's parameters around its forward and, via hooks on its output tensors, its backward.
    That misses (a) modules never called whose parameters the parent reads directly (AttnRes pseudo-queries used
    as vectors) and (b) modules returning tensors inside a dataclass (the MoE router's `Routing`): their backward
    would see an empty partition. One tiny eval-mode forward finds both; their parameters are registered as
    external parameters of the nearest ancestor that was called and returned hookable tensors. Returns the count.
    """
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    hookable: set[int] = set()

    def post(mod: nn.Module, _args: Any, out: Any) -> None:
        if _has_hookable_tensor(out):
            hookable.add(id(mod))

    hooks = [m.register_forward_hook(post) for m in model.modules()]
    rng = torch.get_rng_state()
    was_training = model.training
    try:
        model.eval()
        model(torch.arange(8, dtype=torch.long).remainder(vocab_size).unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
        torch.set_rng_state(rng)
    n = 0

    def visit(module: nn.Module, owner: nn.Module) -> None:
        nonlocal n
        here = module if id(module) in hookable else owner
        if here is not module:
            for p in module.parameters(recurse=False):
                register_external_parameter(owner, p)
                n += 1
        for child in module.children():
            visit(child, here)

    visit(model, model)
    return n


def initialize(cfg: DictConfig, model: nn.Module, ds_config: dict[str, Any], groups=None,
               total_steps: int | None = None):
    """deepspeed.initialize with a client optimizer (or the JSON's for offload) and a LambdaLR schedule."""
    import deepspeed

    if int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3:
        register_external_params_for_zero3(model, int(getattr(getattr(model, "config", None), "vocab_size", 2)))
    opt = build_optimizer(cfg, model, groups)
    fn = lr_lambda(cfg, total_steps)

    def sched(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

    kwargs: dict[str, Any] = dict(model=model, config=ds_config, lr_scheduler=sched)
    if opt is not None:
        kwargs["optimizer"] = opt
    else:
        kwargs["model_parameters"] = groups if groups is not None else param_groups(
            model, float(cfg.schedule.weight_decay))
    engine, optimizer, _, scheduler = deepspeed.initialize(**kwargs)
    return engine, optimizer, scheduler
