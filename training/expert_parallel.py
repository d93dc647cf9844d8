"""Expert parallelism on DeepSpeed's MoE machinery, for the model's own router and balancer.

`setup_expert_parallel(model, ep_size)` (after the process group exists, before `deepspeed.initialize`):
  * creates DeepSpeed's expert-parallel / expert-data-parallel groups `ep_size_<P>` (deepspeed.utils.groups);
  * keeps on each rank only its E/P experts: global ids [r*E/P, (r+1)*E/P) for EP rank r (stacked tensors sliced,
    `experts.expert_offset`/`num_local` set);
  * plugs the dropless all-to-all dispatcher (training/ep/alltoall.py) into every LatentMoE's dispatch seam;
  * presents each LatentExperts to DeepSpeed as a native MoE layer and tags its params (`allreduce=False`,
    `group_name`), so ZeRO 1/2 reduce/partition them over the expert-data-parallel group and checkpoints store one
    file per (layer, global expert id) (training/ep/deepspeed_moe.py).
The returned `EPHandle` carries what the trainer needs: optimizer param groups, the balancer's StatsReducer,
global router counts, full (all-expert) state dicts for HF export, and EP-size-agnostic checkpoint loading.

Routing, balancing statistics and the loss are computed per token on the rank that holds the token: every rank is
a data-parallel rank for the batch, so the balancer reduces over the whole world and its bias does not depend on
EP size, DP size or gradient accumulation. The model itself never imports DeepSpeed.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.checkpoint.store import has_expert_files
from training.ep.alltoall import AllToAllDispatcher
from training.ep.deepspeed_moe import present_as_deepspeed_moe

_EXPERT_WEIGHTS = ("w1", "w3", "w2")
CLIENT_STATE_KEY = "expert_parallel"


def _moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, LatentMoE) pairs in module order."""
    wanted = {id(m) for m in model.moe_layers()}
    return [(n, m) for n, m in model.named_modules() if id(m) in wanted]


@dataclass
class EPHandle:
    """What training needs to know about expert parallelism after `setup_expert_parallel`."""

    ep_size: int
    ep_rank: int
    num_experts: int
    group_name: str | None  # DeepSpeed group name, None when experts are plain params (ZeRO-3, ep_size 1)
    ep_group: Any = None
    edp_group: Any = None
    moe_names: list[str] = field(default_factory=list)

    # --- optimizer ----------------------------------------------------------------------------------------------
    def param_groups(self, model: nn.Module, base_groups: list[dict] | None = None) -> list[dict]:
        """Optimizer groups with expert params split out per DeepSpeed MoE group (ZeRO 1/2 assert otherwise)."""
        if base_groups is None:
            base_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        groups_ = [dict(g, name=g.get("name", f"group{i}"), params=list(g["params"]))
                   for i, g in enumerate(base_groups)]
        if self.group_name is None:
            return groups_
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        return split_params_into_different_moe_groups_for_optimizer(groups_)

    # --- balancing and metrics ------------------------------------------------------------------------------------
    def stats_reducer(self):
        """StatsReducer over every rank: each rank routes its own tokens, the global batch is all ranks' tokens."""
        from training.distributed import DistStatsReducer

        return DistStatsReducer(None)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """model.state_dict() with every MoE layer's stacked experts gathered to all E (collective: call on all
        ranks). Identical whatever the EP size; feed it to a fresh K3ForCausalLM / save_hf_checkpoint."""
        sd = model.state_dict()
        if self.ep_size == 1:
            return sd
        for name in self.moe_names:
            for w in _EXPERT_WEIGHTS:
                key = f"{name}.experts.{w}"
                local = sd[key].detach().contiguous()
                parts = [torch.empty_like(local) for _ in range(self.ep_size)]
                dist.all_gather(parts, local, group=self.ep_group)
                sd[key] = torch.cat(parts, dim=0)
        return sd

    def full_model(self, model: nn.Module) -> nn.Module:
        """A single-process copy of `model` with all experts and the local dispatcher (collective)."""
        sd = self.full_state_dict(model)
        full = type(model)(model.config)
        full.load_state_dict(sd)
        return full

    # --- checkpoints -------------------------------------------------------------------------------------------
    def client_state(self) -> dict[str, Any]:
        """Merge into the client_state of engine.save_checkpoint: the layout the optimizer shards were saved in."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return {CLIENT_STATE_KEY: {"ep_size": self.ep_size, "world_size": world, "num_experts": self.num_experts}}

    def load_checkpoint(self, engine, load_dir: str, tag: str | None = None, **kwargs):
        """engine.load_checkpoint that also works when the checkpoint was written with another EP size or world.

        Expert weights are per global expert id in DeepSpeed's files, so any EP size reads them back; ZeRO
        optimizer shards are per (world, EP) layout, so when the layout differs only the module weights (and
        balancer biases, which are buffers) are restored and the optimizer starts fresh. Returns
        (load_path, client_state, same_layout).
        """
        tag = str(tag if tag is not None else _latest_tag(load_dir))
        if self.group_name is not None and not has_expert_files(os.path.join(load_dir, tag)):
            path, client = self._load_plain_checkpoint(engine, load_dir, tag)
            return path, client, False
        saved = saved_layout(load_dir, tag)
        world = dist.get_world_size() if dist.is_initialized() else 1
        same = saved is None or (saved["ep_size"] == self.ep_size and saved["world_size"] == world)
        if same:
            path, client = engine.load_checkpoint(load_dir, tag, **kwargs)
            return path, client, True
        kwargs.update(load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True)
        path, client = engine.load_checkpoint(load_dir, tag, **kwargs)
        _restore_lr_schedule(engine, os.path.join(load_dir, tag))
        return path, client, False

    def _load_plain_checkpoint(self, engine, load_dir: str, tag: str):
        """A checkpoint written without expert parallelism (stacked experts in the model file): slice our experts
        out of it; weights and buffers only (the optimizer starts fresh)."""
        path = os.path.join(load_dir, tag, "mp_rank_00_model_states.pt")
        from training.checkpoint.safe_load import safe_torch_load

        state = safe_torch_load(path)  # checkpoints are untrusted: weights-only
        module = dict(state["module"])
        num_local = self.num_experts // self.ep_size
        lo = self.ep_rank * num_local
        for name in self.moe_names:
            for w in _EXPERT_WEIGHTS:
                key = f"{name}.experts.{w}"
                module[key] = module[key][lo:lo + num_local]
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
    from training.checkpoint.safe_load import safe_torch_load

    state = safe_torch_load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), mmap=True).get("lr_scheduler")
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
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "num_experts", "ds_autoep_layers"}


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
    path = os.path.join(load_dir, str(tag), "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        return None
    from training.checkpoint.safe_load import safe_torch_load

    state = safe_torch_load(path, mmap=True)
    return state.get(CLIENT_STATE_KEY)


def setup_expert_parallel(model: nn.Module, ep_size: int, zero_stage: int = 0) -> EPHandle:
    """Shard experts over `ep_size` ranks and make DeepSpeed aware of them (see module docstring).

    Call on every rank after `deepspeed.init_distributed()` and before `deepspeed.initialize`, with identical
    full models on every rank (same seed or same checkpoint). `zero_stage` is the DeepSpeed ZeRO stage.
    """
    layers = _moe_layers(model)
    if not layers:
        raise ValueError("setup_expert_parallel: the model has no MoE layers; use parallel.ep_size=1")
    num_experts = int(layers[0][1].experts.num_experts)
    if zero_stage == 3 and ep_size > 1:
        raise ValueError(f"ZeRO-3 with parallel.ep_size={ep_size} is not supported (DeepSpeed refuses MoE layers "
                         "with stage 3); use deepspeed=zero2 for expert parallelism or parallel.ep_size=1 with zero3")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ep_size < 1 or world % ep_size or num_experts % ep_size:
        raise ValueError(f"parallel.ep_size={ep_size} must divide both the world size ({world}) and num_experts "
                         f"({num_experts}); pick a common divisor")
    if zero_stage == 3:  # experts stay ordinary parameters: ZeRO-3 partitions them like any other weight
        return EPHandle(1, 0, num_experts, None, moe_names=[n for n, _ in layers])
    if not dist.is_initialized():
        raise RuntimeError("setup_expert_parallel needs an initialised process group; "
                           "call deepspeed.init_distributed() first")

    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    ep_group = groups._get_expert_parallel_group(name)
    edp_group = groups._get_expert_data_parallel_group(name)
    ep_rank = groups._get_expert_parallel_rank(name)
    num_local = num_experts // ep_size
    offset = ep_rank * num_local
    for _, moe in layers:
        experts = moe.experts
        if experts.num_local != num_experts:
            raise ValueError(f"setup_expert_parallel expects full models (num_local={experts.num_local}, "
                             f"num_experts={num_experts}); call it once, on a freshly built model")
        with torch.no_grad():
            for w in _EXPERT_WEIGHTS:  # same Parameter objects (optimizer groups built earlier stay valid)
                p = getattr(experts, w)
                p.data = p.data[offset:offset + num_local].clone()
        experts.num_local = num_local
        experts.expert_offset = offset
        present_as_deepspeed_moe(experts, num_experts, ep_size)
        if ep_size > 1:
            moe.dispatcher = AllToAllDispatcher(num_experts, ep_group)
    return EPHandle(ep_size, ep_rank, num_experts, name, ep_group, edp_group, [n for n, _ in layers])
