"""Sharded construction: no rank materialises a parameter it does not own.

The model is built on the meta device (no memory, even for the 2.78T config), laid out there (training/parallelize.py:
experts sliced to this rank's E/P, AutoEP tags, dispatcher), then materialised one unit at a time (each decoder
layer, then the embedding/head/final norms) and, under ZeRO-3, converted at once to ZeRO-3 parameters with
deepspeed.zero.Init's own conversion (`_partition`): each rank keeps its 1/W partition of every dense tensor and
its expert-data-parallel partition of its experts. The engine then
finds partitioned params (`is_zero_init_model`) and does not partition or broadcast again; experts were converted
over their expert-data-parallel group (`ds_zero_partition_process_group`), which `_resolve_zero3_param_placement`
checks.

Values: `init_from` reads, per parameter, only the rows covering this rank's partition (model/hf.py HFReader,
`safe_open(...).get_slice`), into an uninitialised full-size buffer whose untouched pages are never resident;
fresh runs run each module's `reset_parameters` under a seed derived from (train.seed, module name), so the
initial weights are the same for every layout (ZeRO stage, EP size, world size). A seeded init is sequential, so
fresh dense tensors are computed whole, one unit at a time, as zero.Init does.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from model import K3Config, K3ForCausalLM
from model.hf import HFReader, target_dtype
from model.lora import LoRASpec, apply_lora
from model.params import build_meta


def module_seed(seed: int, name: str) -> int:
    """Process-independent seed for module `name` (Python's hash() is salted per process)."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def units(model: K3ForCausalLM) -> list[list[tuple[str, nn.Module]]]:
    """Materialisation units: each decoder layer's modules, then every module outside the layers; modules in
    reverse pre-order (children before parents, as `init_weights`), so a parent's own init wins."""
    named = list(model.named_modules())
    layer_names = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    out = [[(n, m) for n, m in named if n == ln or n.startswith(ln + ".")] for ln in layer_names]
    rest = [(n, m) for n, m in named if not any(n == ln or n.startswith(ln + ".") for ln in layer_names)]
    return [list(reversed(u)) for u in out + [rest]]


def owned_range(p: nn.Parameter, zero3: bool) -> tuple[int, int]:
    """[lo, hi) of p's flattened values this rank keeps: under ZeRO-3 its partition over p's partition group
    (partition_parameters `_partition_param`: numel padded to a multiple of the group size, equal chunks)."""
    n = p.numel()
    if not zero3:
        return 0, n
    group = getattr(p, "ds_zero_partition_process_group", None)
    w, r = dist.get_world_size(group), dist.get_rank(group)
    size = (n + w - 1) // w
    return min(n, r * size), min(n, (r + 1) * size)


@torch.no_grad()
def _fill_from_checkpoint(name: str, t: torch.Tensor, reader: HFReader, lo: int, hi: int, offset: int) -> None:
    """Copy flat values [lo, hi) of model tensor `name` from the checkpoint: rows covering them only."""
    if hi <= lo:
        return
    row = max(1, t.numel() // max(1, t.shape[0])) if t.dim() else 1
    shape = tuple(t.shape) if t.dim() else (1,)
    r0, r1 = lo // row, -(-hi // row)
    rows = reader.read(name, shape, r0, r1, expert_offset=offset).reshape(-1)
    t.view(-1)[lo:hi].copy_(rows[lo - r0 * row : hi - r0 * row].to(t.dtype))


def _partition(init, p: nn.Parameter) -> None:
    """Make `p` a ZeRO-3 parameter holding only this rank's partition: zero.Init's `_zero_init_param` without its
    broadcast from rank 0 (partition_parameters: `_convert_to_deepspeed_param`, then `param.partition()`, which
    copies this rank's range of p.data into ds_tensor and frees the rest). Every rank holds the same values for
    its own range (same seed, or the same checkpoint rows), so nothing needs broadcasting, and a rank that read only
    its rows never receives the others' (the broadcast would write, and so make resident, the whole tensor)."""
    p.data = p.data.to(init.local_device)
    init._convert_to_deepspeed_param(p)
    p.partition()


def enable_memory_efficient_linear(init) -> bool:
    """What `with deepspeed.zero.Init(config):` does on entry when `zero_optimization.memory_efficient_linear` is
    true (DeepSpeed's default): replace `torch.nn.functional.linear` by `zero3_linear_wrap`, whose autograd node saves
    the weight *parameter* and re-gathers it in backward (runtime/zero/linear.py). Plain F.linear saves `weight.t()`,
    a view that keeps the gathered full weight alive from forward to backward after ZeRO-3 has released the
    parameter: every dense weight of the model at once (measured on `small`, 2 ranks: 0.43 GB of 0.81 GB gathered;
    for K3 that would be the whole 113 GB of bf16 dense weights). The sharded start converts parameters without
    entering the context (`_partition`), so it makes this one switch itself (partition_parameters
    `InsertPostInitMethodToModuleSubClasses._enable_mem_efficient_linear`; like DeepSpeed's, it persists in the
    process). Returns whether the switch is on."""
    if init.mem_efficient_linear:
        init._enable_mem_efficient_linear()
    return bool(init.mem_efficient_linear)


def materialise(
    model: K3ForCausalLM,
    seed: int,
    zero3_config: dict[str, Any] | None,
    reader: HFReader | None = None,
    dtype: torch.dtype = torch.float32,
    on_unit: Callable[[int], None] | None = None,
) -> None:
    """Give every meta parameter/buffer of `model` its values, unit by unit (see the module docstring).
    `zero3_config`: the DeepSpeed JSON when ZeRO-3 (params are partitioned as they are made), else None."""
    zero3 = zero3_config is not None
    init = None
    if zero3:
        import deepspeed

        init = deepspeed.zero.Init(config_dict_or_path=zero3_config)
        enable_memory_efficient_linear(init)

    for i, unit in enumerate(units(model)):
        made: list[tuple[str, nn.Module]] = []
        for name, mod in unit:
            tensors = list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
            if not any(t.is_meta for _, t in tensors):
                continue
            for pname, t in tensors:  # untouched pages of torch.empty are never resident
                full = f"{name}.{pname}" if name else pname
                new = torch.empty(t.shape, dtype=target_dtype(full, dtype) if t.is_floating_point() else t.dtype)
                if isinstance(t, nn.Parameter):  # same object (tags, external registrations keep pointing at it)
                    attrs = dict(t.__dict__)
                    torch.utils.swap_tensors(t, nn.Parameter(new, requires_grad=t.requires_grad))
                    t.__dict__.update(attrs)
                else:
                    mod._buffers[pname] = new
            made.append((name, mod))
        adapters = [(n, m) for n, m in made if getattr(m, "is_adapter", False)]  # LoRA: never in the checkpoint
        if reader is None or adapters:
            # children first: a parent's reset overrides what it re-initialises
            for name, mod in made if reader is None else adapters:
                if hasattr(mod, "reset_parameters"):
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(module_seed(seed, name))
                        mod.reset_parameters()
        if reader is not None:
            for name, mod in made:
                if getattr(mod, "is_adapter", False):
                    continue
                offset = int(getattr(mod, "expert_offset", 0))
                for pname, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
                    full = f"{name}.{pname}" if name else pname
                    lo, hi = owned_range(t, zero3) if isinstance(t, nn.Parameter) else (0, t.numel())
                    _fill_from_checkpoint(full, t.data if isinstance(t, nn.Parameter) else t, reader, lo, hi, offset)
        if zero3:  # after every reset of the unit (a parent re-initialises its children): partition now
            for _, mod in made:
                for p in mod.parameters(recurse=False):
                    _partition(init, p)
        if on_unit is not None:
            on_unit(i)


def build_model(
    config: K3Config,
    seed: int,
    ep_size: int,
    zero_stage: int,
    ds_config: dict[str, Any],
    init_from: str | None = None,
    expert_files: bool = False,
    sp_size: int = 1,
    lora: LoRASpec | None = None,
):
    """The laid-out, materialised model of this rank and its Parallelism (training/parallelize.py), built sharded
    (module docstring): fresh from `seed`, or from the HF checkpoint directory `init_from`; `lora`: adapters added
    (and the base frozen) on the meta model, before the layout (training/lora.py)."""
    from training.parallelize import parallelize

    model = build_meta(config)
    if lora is not None:
        apply_lora(model, lora)
    par = parallelize(model, ep_size, zero_stage, expert_files=expert_files, sp_size=sp_size)
    reader = HFReader(init_from) if init_from else None
    try:
        materialise(model, seed, ds_config if zero_stage == 3 else None, reader)
    finally:
        if reader is not None:
            par.init_bytes_read = reader.bytes_read
            reader.close()
    if config.vision_config is not None:
        model = attach_vision(model, config, seed, init_from, ds_config if zero_stage == 3 else None)
        par.moe_names = [f"language_model.{n}" for n in par.moe_names]  # names in the wrapped model's state dict
    return model, par


def attach_vision(
    lm: K3ForCausalLM, config: K3Config, seed: int, init_from: str | None, zero3_config: dict[str, Any] | None = None
) -> nn.Module:
    """The laid-out text model inside K3ForConditionalGeneration. The tower and projector are dense (ordinary
    data-parallel parameters for DeepSpeed, EP alike), built as one unit on every rank: each vision module reset
    under the (seed, module name) seed, so every layout starts from the same weights, or the checkpoint's
    `vision_tower.*` / `mm_projector.*` tensors (the release's names, model/hf.py). Under ZeRO-3 (`zero3_config`)
    each vision parameter is then partitioned over the data-parallel group like the text model's dense ones
    (`_partition`: every rank holds the same values, so nothing is broadcast); a rank keeps 1/W of the tower."""
    model = _vision_values(lm, config, seed, init_from)
    if zero3_config is not None:
        import deepspeed

        init = deepspeed.zero.Init(config_dict_or_path=zero3_config)
        for part in (model.vision_tower, model.mm_projector):
            for p in part.parameters():
                _partition(init, p)
    return model


def _vision_values(lm: K3ForCausalLM, config: K3Config, seed: int, init_from: str | None) -> nn.Module:
    from safetensors import safe_open

    from model.hf import VISION_PREFIXES, _tensor_files, _vision_state
    from model.vision.multimodal import K3ForConditionalGeneration

    model = K3ForConditionalGeneration(config, language_model=lm)
    want = {k: v for k, v in model.state_dict().items() if k.startswith(VISION_PREFIXES)}
    if init_from is None:
        for part in ("vision_tower", "mm_projector"):
            for name, m in reversed(list(getattr(model, part).named_modules())):
                if hasattr(m, "reset_parameters"):
                    with torch.random.fork_rng(devices=[]):
                        torch.manual_seed(module_seed(seed, f"{part}.{name}" if name else part))
                        m.reset_parameters()
        return model
    found: dict[str, torch.Tensor] = {}
    for file in _tensor_files(init_from):
        with safe_open(file, framework="pt", device="cpu") as f:
            found.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(VISION_PREFIXES)})  # noqa: SIM118
    state, unknown, missing = _vision_state(found, want, torch.float32)
    if missing or unknown:
        raise ValueError(
            f"model.init_from={init_from}: vision tensors missing {sorted(missing)[:3]}, unexpected "
            f"{sorted(unknown)[:3]}; use a multimodal checkpoint with the same vision_config"
        )
    model.load_state_dict(state, strict=False)
    return model
