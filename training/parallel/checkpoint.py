"""Checkpoints across layouts: resume at another EP size, world size or ZeRO stage.

Same layout: DeepSpeed's own `engine.load_checkpoint` (weights, buffers, optimizer shards, LR schedule).
Another layout:
  * per-expert-file checkpoints (ZeRO 0-2 + EP, training/parallel/ds_moe.py) hold experts by global id, so any EP
    size reads the weights back (weights-only load: module weights, buffers such as balancer biases, LR schedule);
  * a checkpoint without expert files (stacked experts in the model file) is sliced to this rank's experts;
  * in both, and for a ZeRO-1/2 checkpoint of another world size without EP, the ZeRO-1/2 optimizer shards (fp32
    masters, Adam moments, step) are re-partitioned for this layout (training/parallel/zero_reshard.py); ZeRO-0
    optimizer state at another layout is not carried (one warning line: the moments restart);
  * ZeRO-3 + EP ("zero3_partitioned", training/parallel/universal.py) goes through DeepSpeed's universal checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from training.checkpoint.safe_load import CheckpointError, safe_torch_load
from training.checkpoint.store import has_expert_files
from training.parallel.universal import convert, is_zero3_checkpoint, model_states_file, restore_buffers
from training.parallel.zero_reshard import SavedZeroState, checkpoint_zero_stage, optim_files, restore_optimizer

EXPERT_WEIGHTS = ("w1", "w3", "w2")
CLIENT_STATE_KEY = "expert_parallel"


def load_any_layout(par, engine, load_dir: str, tag: str | None = None, **kwargs):
    """engine.load_checkpoint that also works when the checkpoint was written in another layout.

    `par` is the training.parallelize.Parallelism of this run. Returns (load_path, client_state, same_layout).
    """
    tag = str(tag if tag is not None else _latest_tag(load_dir))
    tag_dir = os.path.join(load_dir, tag)
    saved = saved_layout(load_dir, tag)
    world = dist.get_world_size() if dist.is_initialized() else 1
    same = saved is None or (
        saved["ep_size"] == par.ep_size
        and saved["world_size"] == world
        and saved.get("zero_stage", par.zero_stage) == par.zero_stage
    )
    if par.universal is not None:  # ZeRO-3 checkpoint of another layout, converted by `prepare_resume`
        root, utag = par.universal
        # stage3 load_hp_checkpoint_state_from_checkpoint_dir_stage3 gives every param group the hyperparameters
        # of group 0 (weight decay 0.1 for the no-decay group too): keep ours, except the restored lr
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        hyper = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in inner.param_groups]
        path, client = engine.load_checkpoint(root, utag, **kwargs)
        for g, h in zip(inner.param_groups, hyper):
            g.update(h)
        # ... and one `step` tensor for all sub-groups, which torch's AdamW then increments once per sub-group
        # per step (bias correction off by n_subgroups - 1 steps): give each state its own copy
        for st in inner.state.values():
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
        restore_buffers(engine.module, tag_dir)
        return path, client, False
    shards = optim_files(tag_dir)  # ZeRO-1/2: one per rank that wrote it
    world_changed = bool(shards) and len(shards) != world  # DeepSpeed's ZeRO-1/2 load refuses it
    no_ep = par.group_name is None and (saved is None or saved["ep_size"] == 1)
    plain_into_ep = par.ds_moe and not has_expert_files(tag_dir)
    if not plain_into_ep and not world_changed and (same or no_ep):  # DeepSpeed's own load
        path, client = engine.load_checkpoint(load_dir, tag, **kwargs)
        return path, client, True
    if plain_into_ep:
        path, client = _load_plain_checkpoint(par, engine, load_dir, tag)
    else:
        kwargs.update(load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True)
        path, client = engine.load_checkpoint(load_dir, tag, **kwargs)
        _restore_lr_schedule(engine, tag_dir)
    _carry_optimizer(par, engine, tag_dir, saved["ep_size"] if saved else 1)
    return path, client, False


def _carry_optimizer(par, engine, tag_dir: str, saved_ep: int) -> None:
    """After a weights-only load at another layout: the ZeRO-1/2 optimizer state re-partitioned for this one
    (training/parallel/zero_reshard.py); otherwise one warning line (the moments restart from zero)."""
    stage = checkpoint_zero_stage(tag_dir)
    if stage in (1, 2) and par.zero_stage in (1, 2):
        names = [f"{n}.experts.{w}" for n in par.moe_names for w in EXPERT_WEIGHTS]
        n_local = par.num_experts // par.ep_size
        rows = {n: slice(par.ep_rank * n_local, (par.ep_rank + 1) * n_local) for n in names}
        restore_optimizer(engine, SavedZeroState(tag_dir, saved_ep, names), rows)
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"warning: the optimizer state of {tag_dir} (ZeRO-{stage or 0}) cannot be carried to "
            f"ZeRO-{par.zero_stage} at this layout: Adam moments restart from zero (weights, buffers and the LR "
            "schedule are restored); resume it at the layout that wrote it to keep them",
            flush=True,
        )


def prepare_resume(par, ds_config: dict[str, Any], tag_dir: str, run_dir: str) -> dict[str, Any]:
    """Collective, before deepspeed.initialize. A ZeRO-3 checkpoint of another EP size or world size is converted
    to DeepSpeed's universal format (training/parallel/universal.py) and the engine told to load that; other
    cross-stage resumes of zero3_partitioned checkpoints stop with one line. Returns the DeepSpeed JSON to use."""
    saved = saved_layout(*os.path.split(tag_dir.rstrip("/")))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not is_zero3_checkpoint(tag_dir):
        if par.zero_stage == 3 and saved is not None and saved["ep_size"] > 1:
            raise CheckpointError(
                f"{tag_dir} holds per-expert files (ZeRO 0-2 + EP) and cannot resume under ZeRO-3; "
                "resume it with deepspeed=zero2, or export it (python -m training.export) and start "
                "from it with model.init_from"
            )
        return ds_config
    if par.zero_stage != 3:
        raise CheckpointError(
            f"{tag_dir} is a ZeRO-3 checkpoint and resumes only under ZeRO-3 (any EP size or world "
            "size); use deepspeed=zero3, or export it (python -m training.export) and start from it "
            "with model.init_from"
        )
    if saved is not None and saved["ep_size"] == par.ep_size and saved["world_size"] == world:
        return ds_config
    par.universal = convert(tag_dir, run_dir, dist.get_rank() == 0 if dist.is_initialized() else True)
    return {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}


def _load_plain_checkpoint(par, engine, load_dir: str, tag: str):
    """A checkpoint written without expert parallelism (stacked experts in the model file): slice our experts
    out of it; weights and buffers (`load_any_layout` then carries the ZeRO-1/2 optimizer)."""
    path = os.path.join(load_dir, tag, "mp_rank_00_model_states.pt")
    state = safe_torch_load(path)  # checkpoints are untrusted: weights-only
    module = dict(state["module"])
    num_local = par.num_experts // par.ep_size
    lo = par.ep_rank * num_local
    for name in par.moe_names:
        for w in EXPERT_WEIGHTS:
            key = f"{name}.experts.{w}"
            module[key] = module[key][lo : lo + num_local]
    engine.module.load_state_dict(module, strict=True)
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()  # ZeRO 1/2 fp32 master copies from the loaded weights
    client = {k: v for k, v in state.items() if k not in _DEEPSPEED_STATE_KEYS}
    _restore_lr_schedule(engine, os.path.join(load_dir, tag))
    return os.path.join(load_dir, tag), client


def _restore_lr_schedule(engine, tag_dir: str) -> None:
    """The LR schedule is layout-independent: restore it (and the current LR) when the optimizer is not restored."""
    sched = getattr(engine, "lr_scheduler", None)
    if sched is None:
        return
    state = safe_torch_load(model_states_file(tag_dir), mmap=True).get("lr_scheduler")
    if not state:
        return
    groups_ = sched.optimizer.param_groups
    state = dict(state)
    for key in ("base_lrs", "_last_lr"):  # another layout may have another number of param groups (same LRs)
        vals = list(state.get(key) or [])
        if vals and len(vals) != len(groups_) and all(v == vals[0] for v in vals):
            state[key] = [vals[0]] * len(groups_)
    sched.load_state_dict(state)
    lrs = list(state.get("_last_lr") or [])
    if len(lrs) == len(groups_):
        for g, lr in zip(groups_, lrs):
            g["lr"] = lr


_DEEPSPEED_STATE_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "num_experts",
    "ds_autoep_layers",
}


def _latest_tag(load_dir: str) -> str:
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        raise FileNotFoundError(f"no 'latest' file in {load_dir}; pass the checkpoint tag explicitly")
    with open(latest, encoding="utf-8") as f:
        return f.read().strip()


def saved_layout(load_dir: str, tag: str | None = None) -> dict[str, int] | None:
    """The {ep_size, world_size, num_experts} a checkpoint was saved with (None if it does not record it)."""
    if tag is None:
        if not os.path.isfile(os.path.join(load_dir, "latest")):
            return None
        tag = _latest_tag(load_dir)
    try:
        path = model_states_file(os.path.join(load_dir, str(tag)))
    except CheckpointError:
        return None
    state = safe_torch_load(path, mmap=True)
    return state.get(CLIENT_STATE_KEY)
