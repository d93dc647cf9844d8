"""A training job (training/train.py's Trainer, Hydra overrides on the command line) that, after its last step,
also gathers the full model in-process (`Parallelism.full_state_dict`: ZeRO-3 partitions and every EP rank's
experts) and writes it to <run_dir>/gathered.pt on rank 0: the reference `training.export` must reproduce.
With K3_GATHER_AT_START=1 it also writes the model as built, before step 1, and the bytes each rank read from
model.init_from, to <run_dir>/gathered_start.pt (the sharded start's reference). With K3_MEMORY_PROBE=1 (ZeRO-3), after
training, one more forward records what autograd saves for backward and whether the optimizer's fp32 master
partitions are the module's own (<run_dir>/memory_probe.json): the facts the planner's ZeRO-3 memory terms rest on.

    deepspeed --no_local_rank --num_gpus 2 tests/distributed/gather_worker.py <overrides...>
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from training.config import compose, resolve_run_dir, validate  # noqa: E402
from training.distributed import env_world  # noqa: E402
from training.step import pack_microbatch  # noqa: E402
from training.trainer import Trainer  # noqa: E402


def memory_probe(trainer: Trainer) -> dict:
    """One forward under the engine after training (collective), with a saved-tensors hook: bytes autograd keeps for
    backward, and of those the bytes that are views of a gathered (non-persistent) ZeRO-3 weight, which would pin
    the gathered copy after ZeRO-3 releases the parameter. Plus, per optimizer sub-group, whether the fp32 master
    partition is the module partition itself (no second fp32 copy)."""
    live: dict[int, str] = {}  # storage address -> parameter name, while its module runs (gathered)
    names = {id(p): n for n, p in trainer.module.named_parameters()}
    saved: dict[int, int] = {}
    pinned: dict[str, int] = {}

    def own(module: torch.nn.Module) -> list[torch.nn.Parameter]:
        ext = list(getattr(module, "_external_params", {}).values())  # ZeRO-3 gathers these with the module
        return [p for p in [*module.parameters(recurse=False), *ext] if not getattr(p, "ds_persist", False)]

    def pre(module: torch.nn.Module, _args) -> None:  # runs after ZeRO-3's own pre-forward hook has gathered
        live.update({p.data.untyped_storage().data_ptr(): names[id(p)] for p in own(module) if p.data.numel()})

    def post(module: torch.nn.Module, _args, _out) -> None:  # prepended: before ZeRO-3 releases (frees) them
        for p in own(module):
            if p.data.numel():
                live.pop(p.data.untyped_storage().data_ptr(), None)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            if storage.data_ptr() in live:
                pinned[live[storage.data_ptr()]] = storage.nbytes()
        return t

    modules = list(trainer.module.modules())
    hooks = [m.register_forward_pre_hook(pre) for m in modules]
    hooks += [m.register_forward_hook(post, prepend=True) for m in modules]
    mb = pack_microbatch(trainer.loader.next_microbatch(), trainer.ep.sp_size, trainer.ep.sp_rank)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.engine(**mb.model_inputs(trainer.device))
    for h in hooks:
        h.remove()
    opt = trainer.engine.optimizer
    shared = [a is b for a, b in zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat)]
    return {"saved_bytes": sum(saved.values()), "pinned_gathered": pinned, "master_is_module_partition": shared}


def main() -> None:
    cfg = compose(sys.argv[1:])
    trainer = Trainer(cfg, validate(cfg, env_world().world_size))
    if os.environ.get("K3_GATHER_AT_START"):  # the model as built (sharded start), before any step
        state = trainer.ep.full_state_dict(trainer.module)
        sizes = [None] * trainer.world
        torch.distributed.all_gather_object(sizes, trainer.ep.init_bytes_read)
        if trainer.info.is_main:
            torch.save(
                {"state": {k: v.detach().cpu() for k, v in state.items()}, "bytes_read": sizes},
                os.path.join(resolve_run_dir(cfg), "gathered_start.pt"),
            )
    trainer.run()
    state = trainer.ep.full_state_dict(trainer.module)  # collective
    if trainer.info.is_main:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, os.path.join(resolve_run_dir(cfg), "gathered.pt"))
    if os.environ.get("K3_MEMORY_PROBE"):
        probe = memory_probe(trainer)
        if trainer.info.is_main:
            Path(resolve_run_dir(cfg), "memory_probe.json").write_text(json.dumps(probe))


if __name__ == "__main__":
    main()
