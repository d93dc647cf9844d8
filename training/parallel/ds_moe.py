"""Present the model's LatentMoE experts to DeepSpeed as native MoE layers, without DeepSpeed in `model/`.

DeepSpeed's engine treats a module as an MoE layer iff `isinstance(m, deepspeed.moe.layer.MoE)`; it then
(a) reduces/partitions params tagged `allreduce=False, group_name=ep_size_P` over the expert-data-parallel group,
(b) saves each expert in its own file `layer_{L}_expert_{G}_mp_rank_00_model_states.pt` keyed by *global* expert id
    (from `module.state_dict()`, keys must match `.deepspeed_moe.experts.deepspeed_experts.<local id>.`), and strips
    every key under the module's prefix containing "expert" from the main model file,
(c) on load, reads the files of the global ids `ep_rank * num_local + j` this rank owns, renames them to local ids
    and hands them to `module.load_state_dict`.

We make the `LatentExperts` instance (prefix `...block_sparse_moe.experts.`, holding only the stacked `w1, w3, w2`)
that MoE layer by swapping its class for a subclass of (its class, deepspeed MoE) -- MoE.__init__ is never run.
Parameter names stay the HF-style stacked names in `model.state_dict()`; only a *direct* `experts.state_dict()`
(what `_save_moe_checkpoint` calls) returns per-expert slices in DeepSpeed's naming, and loading accepts them back.
Because (b)/(c) key experts by global id, a checkpoint saved at EP=P loads at any EP size that divides E.
"""

from __future__ import annotations

import glob
import os
import re
from collections import OrderedDict

import torch
from torch import nn

_DS_PREFIX = "deepspeed_moe.experts.deepspeed_experts."
_WEIGHTS = ("w1", "w3", "w2")
_EXPERT_KEY = re.compile(r"^(.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w[123]|lora\.w[123]_[AB])$")
_CLASS_CACHE: dict[type, type] = {}


def _ds_moe_class(base: type) -> type:
    """(base, deepspeed.moe.layer.MoE) subclass; base's forward/forward_grouped win in the MRO."""
    if base in _CLASS_CACHE:
        return _CLASS_CACHE[base]
    from deepspeed.moe.layer import MoE

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, **_) -> None:
        """Groups are created by training.parallelize before the engine exists; nothing to do here."""

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        if args or destination is not None or prefix:  # recursion from the model: stacked HF-style tensors
            return base.state_dict(self, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        # direct call (DeepSpeed's _save_moe_checkpoint): one entry per local expert, DeepSpeed's naming; every
        # tensor is stacked per expert (w1/w3/w2 and, with LoRA, `lora.w1_A`...); frozen ones (a LoRA base,
        # re-read from model.init_from on resume) are left out, so a LoRA checkpoint holds adapters only
        stacked = base.state_dict(self, keep_vars=True)
        frozen = {n for n, p in self.named_parameters() if not p.requires_grad}
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for j in range(self.num_local):
            for name, t in stacked.items():
                if name not in frozen:
                    out[f"{_DS_PREFIX}{j}.{name}"] = t[j] if keep_vars else t[j].detach()
        return out

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # DeepSpeed's load_moe_state_dict hands us per-expert slices (local ids): stack them first
        for w in base.state_dict(self, keep_vars=True):
            keys = [f"{prefix}{_DS_PREFIX}{j}.{w}" for j in range(self.num_local)]
            if all(k in state_dict for k in keys):
                state_dict[prefix + w] = torch.stack([state_dict.pop(k) for k in keys])
        base._load_from_state_dict(
            self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    cls = type(
        f"DeepSpeedMoE{base.__name__}",
        (base, MoE),
        {
            "__doc__": f"{base.__name__} presented to DeepSpeed as a native MoE layer (training/parallel/ds_moe.py).",
            "set_deepspeed_parallelism": set_deepspeed_parallelism,
            "state_dict": state_dict,
            "_load_from_state_dict": _load_from_state_dict,
            "forward": base.forward,
        },
    )
    _CLASS_CACHE[base] = cls
    return cls


def present_as_deepspeed_moe(experts: nn.Module, num_experts: int, ep_size: int) -> nn.Module:
    """Turn a (sliced) LatentExperts into a DeepSpeed MoE layer in place and tag its params as expert params."""
    group_name = f"ep_size_{ep_size}"
    experts.__class__ = _ds_moe_class(type(experts))
    # the attributes DeepSpeed's engine and checkpoint code read from a native MoE layer
    experts.ep_size = ep_size
    experts.expert_group_name = group_name
    experts.num_local_experts = num_experts // ep_size
    experts.use_residual = False
    experts.enable_expert_tensor_parallelism = False
    experts.num_experts = num_experts
    for p in experts.parameters(recurse=True):
        p.allreduce = False
        p.group_name = group_name
    return experts


def undo_deepspeed_moe(experts: nn.Module) -> nn.Module:
    """Back to the plain class (for a gathered full model or export)."""
    for base, cls in _CLASS_CACHE.items():
        if type(experts) is cls:
            experts.__class__ = base
    for p in experts.parameters():
        for attr in ("allreduce", "group_name"):
            if hasattr(p, attr):
                delattr(p, attr)
    return experts


def consolidated_module_state(tag_dir: str | os.PathLike, mp_rank: int = 0) -> dict[str, torch.Tensor]:
    """Full model state dict (all experts, stacked) from a DeepSpeed MoE checkpoint tag directory, any EP size.

    Reads `mp_rank_XX_model_states.pt` (non-expert weights) and every `layer_*_expert_*` file, stacking the
    per-expert slices by global id into `<prefix>.w1/w3/w2`. For HF export in a single process.
    """
    tag_dir = os.fspath(tag_dir)
    main = os.path.join(tag_dir, f"mp_rank_{mp_rank:02d}_model_states.pt")
    if not os.path.isfile(main):
        raise FileNotFoundError(f"no {main}; pass a checkpoint tag directory (e.g. run_dir/checkpoints/global_step10)")
    from training.checkpoint.safe_load import safe_torch_load  # checkpoints are untrusted: weights-only

    sd = dict(safe_torch_load(main)["module"])
    slices: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    files = sorted(glob.glob(os.path.join(tag_dir, f"layer_*_expert_*_mp_rank_{mp_rank:02d}_model_states.pt")))
    for f in files:
        for key, t in safe_torch_load(f).items():
            m = _EXPERT_KEY.match(key)
            if m is None:
                raise ValueError(f"unexpected key {key!r} in expert file {f}; not a k3-train expert checkpoint")
            slices.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
    for (prefix, w), by_id in slices.items():
        ids = sorted(by_id)
        if ids != list(range(len(ids))):
            raise ValueError(
                f"expert files for {prefix}.{w} cover ids {ids}, not 0..{len(ids) - 1}: checkpoint incomplete"
            )
        sd[f"{prefix}.{w}"] = torch.stack([by_id[i] for i in ids])
    return sd
