"""How K3 is parallelised on DeepSpeed: the one place that says it (cf. torchtitan's parallelize.py).

Layouts (world W ranks, expert parallelism P = `parallel.ep_size`, expert-data parallelism W/P):
  * every rank is a data-parallel rank for the batch: it routes its own tokens, and the balancer reduces its
    statistics over the whole world, so router biases depend on the global batch only (`stats_reducer`);
  * P > 1: EP rank r keeps the global experts [r*E/P, (r+1)*E/P) (`experts.expert_offset/num_local`, the model's
    seam) and the dropless latent all-to-all dispatcher (training/parallel/alltoall.py) replaces
    `LatentMoE.dispatcher`; DeepSpeed's groups `ep_size_P` are the EP and expert-data-parallel groups;
  * ZeRO 0-2 + EP: each LatentExperts is presented to DeepSpeed as a native MoE layer (training/parallel/ds_moe.py,
    per-expert checkpoint files); expert params carry `allreduce=False, group_name`, so ZeRO 1/2 reduce and
    partition them over the expert-data-parallel group;
  * ZeRO-3 + EP: each LatentMoE is presented as an `AutoEPMoELayer` instance (`present_as_autoep`): DeepSpeed
    (>= 0.19.3) then partitions dense params over all ranks and the expert params, tagged with AutoEP's placement
    family, over the expert-data-parallel group: `engine._validate_zero3_moe_compatibility` (accepts AutoEP
    layers), `engine._resolve_zero3_param_placement` (reads `ds_zero_placement_family` /
    `ds_zero_partition_group_name`), `stage3._autoep_expert_parallel_group` (grad averaging over the world,
    grad-norm all-reduce over EP), `engine._save_moe_checkpoint` (reads `ep_group_name, num_local_experts,
    ep_size, ep_rank, expert_placement_descriptor` and `experts.w1/w2/w3` with `ds_autoep_uc_meta`). Only
    placement and partitioning are DeepSpeed's: router, Quantile Balancing, SiTU-GLU experts, latent
    projections and the all-to-all stay K3's (AutoEP's own forward, router and experts are never used);
  * ZeRO-3 (any P): parameters read outside their module's forward become external params of the nearest module
    whose hooks see them (`register_zero3_external_params`);
  * S = `parallel.sp_size` > 1 (Ulysses): groups of S consecutive ranks share their rows and split each sequence
    (training/parallel/ulysses.py, DeepSpeed's sequence-parallel mpu and all-to-all); the mixers get the seam
    `model.set_sequence_shard`. Every rank still routes only its own tokens, so EP and the balancer see S x as
    many data-parallel ranks, each with T/S tokens. ZeRO-3 + EP + SP keeps the AutoEP presentation; DeepSpeed's
    assertion against SP there is lifted for one `deepspeed.initialize` (training/parallel/autoep_sp.py says why
    partition groups, expert groups, gradient averaging and norms hold). ZeRO-3 + SP at P = 1 leaves the experts
    as plain parameters partitioned over all ranks.
`check_layout` refuses, before any process group exists, what DeepSpeed 0.19.8 cannot do with AutoEP + ZeRO-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from model import K3Config
from model.lora import apply_lora
from training.distributed import DistStatsReducer
from training.parallel.alltoall import AllToAllDispatcher
from training.parallel.checkpoint import CLIENT_STATE_KEY, load_any_layout, prepare_resume
from training.parallel.ds_moe import present_as_deepspeed_moe
from training.parallel.ulysses import ulysses_shard

EXPERT_WEIGHTS = ("w1", "w3", "w2")
AUTOEP_FAMILY = "autoep_expert"


class LayoutError(ValueError):
    """A parallel layout DeepSpeed cannot run; one line naming the combination and the alternative."""


# --- refusals (before any process group) ------------------------------------------------------------------------
def check_layout(zero_stage: int, ep_size: int, ds_config: dict[str, Any]) -> None:
    """Raise LayoutError for combinations DeepSpeed 0.19.8 refuses with AutoEP + ZeRO-3 (engine.
    `_validate_zero3_moe_compatibility`, `_save_moe_checkpoint`): here they fail in a second, not after start-up.
    Sequence parallelism is the exception it lifts (training/parallel/autoep_sp.py), while the DeepSpeed sources
    that reasoning reads are the reviewed ones."""
    z = ds_config.get("zero_optimization", {}) or {}
    sp = int(ds_config.get("sequence_parallel_size", 1) or 1)
    if zero_stage == 3 and sp > 1 and z.get("reduce_scatter") is False:
        raise LayoutError(
            f"ZeRO-3 with parallel.sp_size={sp} needs zero_optimization.reduce_scatter=true (the gradient scaling "
            "training/parallel/ulysses.py relies on); drop reduce_scatter from deepspeed.extra"
        )
    if zero_stage != 3 or ep_size <= 1:
        return
    what = f"ZeRO-3 with parallel.ep_size={ep_size}"
    if sp > 1:  # DeepSpeed asserts against it; training/parallel/autoep_sp.py lifts that for the reviewed sources
        from training.parallel.autoep_sp import DEEPSPEED_VERSION, contract_drift

        drift = contract_drift()
        if drift:
            raise LayoutError(
                f"{what} and parallel.sp_size={sp} relies on DeepSpeed {DEEPSPEED_VERSION} internals that changed "
                f"({', '.join(drift)}); re-verify training/parallel/autoep_sp.py, or use deepspeed=zero2 with EP"
            )
    if int(z.get("zero_hpz_partition_size", 1) or 1) > 1:
        raise LayoutError(
            f"{what} cannot use hpZ (zero_hpz_partition_size>1, refused by DeepSpeed AutoEP + ZeRO-3); "
            "drop zero_hpz_partition_size or use parallel.ep_size=1"
        )
    if z.get("zero_quantized_gradients") or z.get("zeropp_loco_param"):
        raise LayoutError(
            f"{what} cannot use qgZ/LoCo quantized gradients (refused by DeepSpeed AutoEP + ZeRO-3); "
            "drop zero_quantized_gradients/zeropp_loco_param or use parallel.ep_size=1"
        )
    if int(z.get("mics_shard_size", -1) or -1) > 0:
        raise LayoutError(
            f"{what} cannot use MiCS (mics_shard_size, not an AutoEP-aware ZeRO-3 optimizer); "
            "drop mics_shard_size: ZeRO-3 already partitions experts over the expert-data-parallel group"
        )
    etp = (ds_config.get("expert_parallel", {}) or {}).get("expert_tensor_parallel_size", 1)
    if int(etp or 1) != 1:
        raise LayoutError(
            f"{what} supports only expert_parallel.expert_tensor_parallel_size=1 (DeepSpeed AutoEP + "
            "ZeRO-3); drop it and raise parallel.ep_size instead"
        )
    for key in ("offload_optimizer", "offload_param"):
        if ((z.get(key) or {}).get("device") or "none") == "nvme":
            raise LayoutError(
                f"{what} cannot checkpoint with NVMe {key.split('_')[1]} swapping (DeepSpeed AutoEP + "
                "ZeRO-3 restores experts from optimizer shards); use deepspeed=zero3_offload (CPU)"
            )


# --- the handle -------------------------------------------------------------------------------------------------
@dataclass
class Parallelism:
    """What training needs to know about the layout after `parallelize`."""

    ep_size: int
    ep_rank: int
    num_experts: int
    zero_stage: int
    group_name: str | None  # DeepSpeed's ep_size_P group, None without expert parallelism
    ep_group: Any = None
    edp_group: Any = None
    moe_names: list[str] = field(default_factory=list)
    universal: tuple[str, str] | None = None  # (load_dir, tag) of a converted universal checkpoint to resume
    init_bytes_read: int = 0  # tensor bytes this rank read from model.init_from (sharded start)
    sp_size: int = 1
    sp_rank: int = 0
    mpu: Any = None  # DeepSpeed's sequence-parallel groups for deepspeed.initialize(mpu=), None without SP

    @property
    def autoep(self) -> bool:
        """ZeRO-3 + EP: experts presented as AutoEP layers (zero3_partitioned checkpoints)."""
        return self.zero_stage == 3 and self.group_name is not None

    @property
    def ds_moe(self) -> bool:
        """ZeRO 0-2 + EP: experts presented as native DeepSpeed MoE layers (per-expert checkpoint files)."""
        return self.zero_stage < 3 and self.group_name is not None

    def param_groups(self, model: nn.Module, base_groups: list[dict] | None = None) -> list[dict]:
        """Optimizer groups; for native-MoE presentation split per expert group (ZeRO 1/2 assert otherwise).
        ZeRO-3 builds its own sub-groups per partition group (stage3 `_get_param_partition_group`)."""
        if base_groups is None:
            base_groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        groups_ = [
            dict(g, name=g.get("name", f"group{i}"), params=list(g["params"])) for i, g in enumerate(base_groups)
        ]
        if not self.ds_moe:
            return groups_
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        return split_params_into_different_moe_groups_for_optimizer(groups_)

    def stats_reducer(self) -> DistStatsReducer:
        """Balancer statistics over every rank: the global batch is all ranks' tokens, whatever P."""
        return DistStatsReducer(None)

    def client_state(self) -> dict[str, Any]:
        """Merged into engine.save_checkpoint's client_state: the layout the shards were written in."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return {
            CLIENT_STATE_KEY: {
                "ep_size": self.ep_size,
                "world_size": world,
                "num_experts": self.num_experts,
                "zero_stage": self.zero_stage,
            }
        }

    @torch.no_grad()
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """model.state_dict() with ZeRO-3 partitions gathered and every expert (all E, stacked), identical for
        any layout (collective: call on all ranks)."""
        if self.zero_stage == 3:
            from deepspeed.runtime.zero.partition_parameters import GatheredParameters

            with GatheredParameters(list(model.parameters())):
                sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            sd = model.state_dict()
        if self.ep_size == 1:
            return sd
        for name in self.moe_names:
            for w in EXPERT_WEIGHTS:
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

    def prepare_resume(self, ds_config: dict[str, Any], tag_dir: str, run_dir: str) -> dict[str, Any]:
        """Collective, before deepspeed.initialize: the DeepSpeed JSON for resuming `tag_dir` at this layout
        (universal-checkpoint load for ZeRO-3 of another layout; training/parallel/checkpoint.py)."""
        return prepare_resume(self, ds_config, tag_dir, run_dir)

    def load_checkpoint(self, engine, load_dir: str, tag: str | None = None, **kwargs):
        """engine.load_checkpoint that also reads checkpoints of another layout; see training/parallel/checkpoint.py."""
        return load_any_layout(self, engine, load_dir, tag, **kwargs)


# --- ZeRO-3 presentation ---------------------------------------------------------------------------------------
_AUTOEP_CLASSES: dict[type, type] = {}


def _autoep_class(base: type) -> type:
    """(base, AutoEPMoELayer): base's forward and everything else win in the MRO; AutoEPMoELayer.__init__ is never
    run. The engine only needs `isinstance(m, AutoEPMoELayer)` and the attributes set in `present_as_autoep`."""
    if base not in _AUTOEP_CLASSES:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, **_: Any) -> None:
            """Groups exist already (`parallelize`); the engine calls this for every AutoEP layer."""

        _AUTOEP_CLASSES[base] = type(
            f"AutoEP{base.__name__}",
            (base, AutoEPMoELayer),
            {
                "__doc__": f"{base.__name__} presented to ZeRO-3 as an AutoEP layer (training/parallelize.py).",
                "forward": base.forward,
                "set_deepspeed_parallelism": set_deepspeed_parallelism,
            },
        )
    return _AUTOEP_CLASSES[base]


def present_as_autoep(moe: nn.Module, num_experts: int, ep_size: int, ep_rank: int, ep_group, edp_group) -> nn.Module:
    """Make a (sliced) LatentMoE an AutoEPMoELayer in place and tag its experts with AutoEP's ZeRO-3 placement."""
    from deepspeed.checkpoint.autoep_affine import (
        autoep_experts_for_rank,
        autoep_placement_to_affine_map,
        legacy_uniform_autoep_placement_descriptor,
    )
    from deepspeed.checkpoint.constants import (
        AFFINE_MAP,
        AUTOEP_EXPERT_PLACEMENT,
        AUTOEP_PARAM_EP_RANK,
        AUTOEP_PARAM_LOCAL_EXPERTS,
        AUTOEP_PARAM_LOGICAL_SHAPE,
        DS_AUTOEP_UC_META,
    )

    name, num_local = f"ep_size_{ep_size}", num_experts // ep_size
    moe.__class__ = _autoep_class(type(moe))
    placement = legacy_uniform_autoep_placement_descriptor(num_experts, num_local, ep_size)
    # the attributes engine._save_moe_checkpoint / _validate_autoep_zero3_partitioned_metadata read
    moe.ep_group_name, moe.ep_group, moe.ep_size, moe.ep_rank = name, ep_group, ep_size, ep_rank
    moe.num_local_experts, moe.expert_placement_descriptor = num_local, placement
    moe.folding_group_handles = None
    local = list(autoep_experts_for_rank(placement, ep_rank))
    for w in EXPERT_WEIGHTS:
        if w not in moe.experts._parameters:  # lora.base_experts=mxfp4: buffers, not partitioned by ZeRO-3
            continue
        p = getattr(moe.experts, w)
        shape = [num_experts, *getattr(p, "ds_shape", p.shape)[1:]]
        setattr(
            p,
            DS_AUTOEP_UC_META,
            {
                AUTOEP_EXPERT_PLACEMENT: placement,
                AFFINE_MAP: autoep_placement_to_affine_map(placement, shape).to_dict(),
                AUTOEP_PARAM_LOGICAL_SHAPE: shape,
                AUTOEP_PARAM_EP_RANK: ep_rank,
                AUTOEP_PARAM_LOCAL_EXPERTS: local,
            },
        )
        tag_expert_param(p, name, zero3=True)
        p.ds_zero_partition_process_group = edp_group  # read by zero.Init's _convert_to_deepspeed_param
    if moe.experts.lora is not None:  # LoRA factors of these experts: the same placement (no universal metadata)
        for p in moe.experts.lora.parameters():
            tag_expert_param(p, name, zero3=True)
            p.ds_zero_partition_process_group = edp_group
    return moe


def tag_expert_param(p: nn.Parameter, group_name: str, zero3: bool) -> None:
    """The tags DeepSpeed reads off an expert param (the same ones auto_ep_layer.AutoEPMoELayer.__init__ sets)."""
    p.allreduce = False
    p.group_name = group_name
    if zero3:
        p.ds_zero_placement_family = AUTOEP_FAMILY
        p.ds_zero_partition_group_name = group_name


# --- ZeRO-3: parameters read outside their module's forward ------------------------------------------------------
def _has_hookable_tensor(value: Any) -> bool:
    """Whether DeepSpeed's module hooks can see a tensor in this output (tensors in tuples/lists/dicts only)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_hookable_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_hookable_tensor(v) for v in value.values())
    return False


def structural_twin(config: K3Config) -> K3Config:
    """`config` with every width shrunk (same layers, layer types, MoE/AttnRes/MLA structure, parameter names):
    a model that runs a forward in milliseconds whatever the size of the real one."""
    lac = {**config.linear_attn_config, "num_heads": 2, "head_dim": 16}
    widths: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 32,
        "moe_intermediate_size": 32,  # 32: an MXFP4 group (lora.base_experts=mxfp4)
        "routed_expert_hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "linear_attn_config": lac,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "vision_config": None,  # the twin is the text model (K3ForCausalLM): the tower is not part of it
        "media_placeholder_token_id": None,
    }
    if config.q_lora_rank is not None:
        widths["q_lora_rank"] = 16
    return config.replace(**widths)


@torch.no_grad()
def register_zero3_external_params(model: nn.Module) -> int:
    """Make ZeRO-3 gather every parameter where it is used.

    ZeRO-3 gathers a module's parameters around its forward and, via hooks on its output tensors, its backward.
    That misses (a) modules never called whose parameters the parent reads directly (AttnRes pseudo-queries,
    the stacked experts that the dispatchers read), and (b) modules returning tensors inside a dataclass (the
    router's `Routing`). One eval-mode forward of the model's structural twin (real layer structure, tiny widths,
    so it also works on a meta-device model) finds both by name; those parameters of `model` are registered as
    external parameters (`partition_parameters.register_external_parameter`) of the nearest called ancestor
    that returned hookable tensors. Returns the count.
    """
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    with torch.random.fork_rng(devices=[]):
        twin = type(model)(structural_twin(model.config)).eval()
        if getattr(model, "lora_spec", None) is not None:
            apply_lora(twin, model.lora_spec)
    if [n for n, _ in twin.named_parameters()] != [n for n, _ in model.named_parameters()]:
        raise RuntimeError("structural_twin changed the parameter names; keep it in step with model/config.py")
    hookable: set[str] = set()
    names = {id(m): n for n, m in twin.named_modules()}

    def post(mod: nn.Module, _args: Any, out: Any) -> None:
        if _has_hookable_tensor(out):
            hookable.add(names[id(mod)])

    hooks = [m.register_forward_hook(post) for m in twin.modules()]
    try:
        ids = torch.arange(8, dtype=torch.long).unsqueeze(0)
        twin(ids, **({"labels": ids} if getattr(model.config, "mtp_depth", 0) else {}))  # MTP runs with a loss
    finally:
        for h in hooks:
            h.remove()
    n = 0

    def visit(prefix: str, module: nn.Module, owner: nn.Module) -> None:
        nonlocal n
        here = module if prefix in hookable else owner
        if here is not module:
            for p in module.parameters(recurse=False):
                register_external_parameter(owner, p)
                n += 1
        for name, child in module.named_children():
            visit(f"{prefix}.{name}" if prefix else name, child, here)

    visit("", model, model)
    return n


# --- entry point -----------------------------------------------------------------------------------------------
def _moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    wanted = {id(m) for m in model.moe_layers()}
    return [(n, m) for n, m in model.named_modules() if id(m) in wanted]


def expert_groups(ep_size: int) -> tuple[str, Any, Any, int]:
    """DeepSpeed's expert-parallel / expert-data-parallel groups `ep_size_P` (created once; deepspeed.utils.groups
    `_create_expert_and_data_parallel`): (name, ep_group, edp_group, ep_rank)."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return (
        name,
        groups._get_expert_parallel_group(name),
        groups._get_expert_data_parallel_group(name),
        groups._get_expert_parallel_rank(name),
    )


def shard_experts(moe: nn.Module, num_local: int, offset: int) -> None:
    """Keep only experts [offset, offset + num_local) of a full LatentMoE (same Parameter objects)."""
    experts = moe.experts
    if experts.num_local != experts.num_experts:
        raise ValueError(
            f"parallelize expects full models (num_local={experts.num_local}, "
            f"num_experts={experts.num_experts}); call it once, on a freshly built model"
        )
    with torch.no_grad():
        for w in EXPERT_WEIGHTS:
            if w in experts._parameters:
                p = getattr(experts, w)
                p.data = p.data[offset : offset + num_local].clone()
            else:  # lora.base_experts=mxfp4: the codes are buffers (model/moe/mxfp4_experts.py)
                for b in (f"{w}_packed", f"{w}_scale"):
                    experts._buffers[b] = experts._buffers[b][offset : offset + num_local].clone()
    if experts.lora is not None:  # LoRA: the stacked expert factors go with their experts
        experts.lora.slice_(offset, num_local)
    experts.num_local, experts.expert_offset = num_local, offset


def parallelize(
    model: nn.Module, ep_size: int, zero_stage: int, expert_files: bool = False, sp_size: int = 1
) -> Parallelism:
    """Lay K3 out for `ep_size`, `zero_stage` and `sp_size` (see the module docstring). Call on every rank after
    the process group exists and before deepspeed.initialize. ZeRO-3 presents experts as AutoEP layers at every P
    without SP (so its checkpoints reshard through the universal format); `expert_files`: ZeRO 0-2 present them as
    DeepSpeed MoE even at P=1 (resuming a per-expert-file checkpoint). ZeRO-3 external params are registered here
    too."""
    layers = _moe_layers(model)
    if not layers and ep_size > 1:
        raise ValueError("parallel.ep_size>1 needs MoE layers; this model has none, use parallel.ep_size=1")
    num_experts = int(layers[0][1].experts.num_experts) if layers else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if ep_size < 1 or world % ep_size or (layers and num_experts % ep_size):
        raise ValueError(
            f"parallel.ep_size={ep_size} must divide both the world size ({world}) and num_experts "
            f"({num_experts}); pick a common divisor"
        )
    names = [n for n, _ in layers]
    handle = Parallelism(1, 0, num_experts, zero_stage, None, moe_names=names)
    if layers and (ep_size > 1 or (zero_stage == 3 and sp_size == 1) or expert_files):
        if not dist.is_initialized():
            raise RuntimeError("parallelize needs an initialised process group; call deepspeed.init_distributed()")
        name, ep_group, edp_group, ep_rank = expert_groups(ep_size)
        num_local = num_experts // ep_size
        for _, moe in layers:
            if moe.experts.num_local == num_experts and ep_size > 1:
                shard_experts(moe, num_local, ep_rank * num_local)
            if zero_stage == 3:
                present_as_autoep(moe, num_experts, ep_size, ep_rank, ep_group, edp_group)
            else:
                present_as_deepspeed_moe(moe.experts, num_experts, ep_size)
            if ep_size > 1:
                moe.dispatcher = AllToAllDispatcher(num_experts, ep_group)
        handle = Parallelism(ep_size, ep_rank, num_experts, zero_stage, name, ep_group, edp_group, names)
    if sp_size > 1:
        shard, handle.mpu = ulysses_shard(sp_size)
        handle.sp_size, handle.sp_rank = shard.size, shard.rank
        model.set_sequence_shard(shard)
    if zero_stage == 3:
        register_zero3_external_params(model)
    return handle
