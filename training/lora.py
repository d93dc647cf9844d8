"""LoRA fine-tuning, the training side: the spec from the config, the base's identity, the adapter file.

The maths is model/lora.py. Here: `finetune=lora` adds adapters to the meta model before it is laid out
(training/parallel/construct.py), so expert parallelism slices the stacked expert factors with the experts
(training/parallelize.py `shard_experts`) and ZeRO-3 partitions them with them (AutoEP tags). Every base parameter
has requires_grad=False: the optimizer groups (training/engine.py `param_groups`) hold only adapters, so DeepSpeed
keeps no gradient buffer, no optimizer state and no fp32 master for the base (ZeRO-1/2 flatten only the
optimizer's params, `stage_1_and_2.DeepSpeedZeroOptimizer.__init__`; ZeRO-3 partitions every module param but
builds fp32 partitions only for the optimizer's groups, `stage3._create_fp32_partitions`). Checkpoints leave the
base out (`engine.save_checkpoint(exclude_frozen_parameters=True)`, loaded back with `load_module_strict=False`):
a resume re-reads the base from `model.init_from`, whose identity (path + content hash) is part of the run
identity (training/checkpoint/identity.py), so resuming on another base is refused in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from safetensors.torch import load_file, save_file

from model.lora import LoRASpec, adapter_state

ADAPTER_FILE = "lora.json"  # in every checkpoint tag dir of a LoRA run: the spec and the base identity
ADAPTER_WEIGHTS = "adapters.safetensors"  # ... and the whole adapters (all experts), whatever the layout
_WHOLE_FILE_BYTES = 256 << 20  # files up to this size are hashed whole
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 20  # larger ones: header + 64 evenly spaced 1 MiB blocks


def lora_spec(cfg: DictConfig) -> LoRASpec | None:
    """The adapter spec of a `finetune=lora` run, else None."""
    if str(cfg.get("finetune", "none")) != "lora":
        return None
    lo = cfg.lora
    return LoRASpec(
        rank=int(lo.rank),
        expert_rank=int(lo.expert_rank),
        alpha=float(lo.alpha),
        dropout=float(lo.dropout),
        targets=tuple(str(t) for t in lo.targets),
        base_experts=str(lo.base_experts),
    )


def _file_digest(path: str) -> str:
    """sha256 of a file: whole up to 256 MiB; else its first 1 MiB (the safetensors header: names, dtypes,
    shapes, offsets), 64 evenly spaced 1 MiB blocks and its size (a 1.45 TB release hashes in seconds)."""
    h, size = hashlib.sha256(), os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE_BYTES:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            for i in range(_SAMPLES + 1):
                f.seek(0 if i == 0 else (size - _SAMPLE_BYTES) * i // _SAMPLES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def base_identity(init_from: str) -> dict[str, str]:
    """{'base.path', 'base.hash'}: the frozen base a LoRA run adapts (hash over its config and weight files)."""
    path = os.path.abspath(init_from)
    names = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".json")) and not n.startswith("."))
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0" + _file_digest(os.path.join(path, n)).encode())
    return {"base.path": path, "base.hash": h.hexdigest()}


def adapter_record(cfg: DictConfig, identity: dict[str, Any]) -> dict[str, Any]:
    """What `lora.json` holds: the spec (model/lora.py names) and the base identity (from the run identity,
    training/checkpoint/identity.py, so the base is hashed once per job)."""
    spec = lora_spec(cfg)
    assert spec is not None
    return {
        "rank": spec.rank,
        "expert_rank": spec.expert_rank,
        "alpha": spec.alpha,
        "dropout": spec.dropout,
        "targets": list(spec.targets),
        "base_experts": str(cfg.lora.base_experts),
        "base.path": identity["base.path"],
        "base.hash": identity["base.hash"],
    }


def write_adapter_record(tag_dir: str, record: dict[str, Any]) -> None:
    with open(os.path.join(tag_dir, ADAPTER_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)


def read_adapter_record(tag_dir: str) -> dict[str, Any] | None:
    """The LoRA record of a checkpoint tag dir, or None for a full-training checkpoint."""
    path = os.path.join(tag_dir, ADAPTER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def spec_of(record: dict[str, Any]) -> LoRASpec:
    return LoRASpec(
        rank=int(record["rank"]),
        expert_rank=int(record["expert_rank"]),
        alpha=float(record["alpha"]),
        dropout=float(record["dropout"]),
        targets=tuple(record["targets"]),
        base_experts=str(record.get("base_experts", "bf16")),
    )


@contextlib.contextmanager
def checkpoint_without_autoep(model: Any, autoep: bool) -> Iterator[None]:
    """Around engine.save_checkpoint / load_checkpoint of a LoRA run under ZeRO-3 + EP (AutoEP presentation).

    DeepSpeed 0.19.8 `_save_moe_checkpoint` refuses frozen AutoEP experts ("frozen fragments are not stored in
    ZeRO optimizer shards") and its partition-native format restores every AutoEP expert from optimizer shards.
    A LoRA checkpoint needs no base experts (a resume re-reads them from model.init_from), so for the duration
    of the save/load each LatentMoE shows its plain class: the engine then writes (and reads) the module state
    (adapters) and the ZeRO optimizer shards, where the expert adapters live in their expert-data-parallel
    partitions like any parameter's; the AutoEP tags on the parameters stay, and nothing runs forward meanwhile."""
    swapped = []
    if autoep:
        for moe in model.moe_layers():
            cls = type(moe)
            if cls.__name__.startswith("AutoEP"):
                moe.__class__ = cls.__bases__[0]
                swapped.append((moe, cls))
    try:
        yield
    finally:
        for moe, cls in swapped:
            moe.__class__ = cls


@torch.no_grad()
def gather_adapters(model: Any, par: Any) -> dict[str, torch.Tensor]:
    """Every adapter tensor whole (ZeRO-3 partitions gathered, expert factors of all EP ranks stacked by global
    expert id), on every rank (collective). Adapters are small: this is what export reads, for any layout."""
    params = adapter_state(model)
    if par.zero_stage == 3:
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters(list(params.values())):
            sd = {k: v.detach().clone() for k, v in params.items()}
    else:
        sd = {k: v.detach().clone() for k, v in params.items()}
    if par.ep_size > 1:
        for name in sorted(sd):
            if ".experts.lora." in f".{name}":
                parts = [torch.empty_like(sd[name]) for _ in range(par.ep_size)]
                dist.all_gather(parts, sd[name].contiguous(), group=par.ep_group)
                sd[name] = torch.cat(parts, dim=0)
    return sd


def write_adapter_weights(tag_dir: str, tensors: dict[str, torch.Tensor]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tag_dir, ADAPTER_WEIGHTS))


def read_adapter_weights(tag_dir: str) -> dict[str, torch.Tensor]:
    path = os.path.join(tag_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; this LoRA checkpoint is incomplete, use an earlier one")
    return load_file(path)
