"""Export from a launcher's ranks (issue 37 §2): every node writes its share of the shards at once.

Started by `deepspeed`, `torchrun` or `srun` (RANK / WORLD_SIZE / MASTER_ADDR in the environment, OUT on storage
every node sees), `training.export` joins a gloo group: rank 0 checks OUT and makes the staging directory beside it
(and, for ZeRO-3, runs DeepSpeed's universal conversion once, whose barrier releases the other ranks); every rank
plans the same shards from the sizes and writes those with index % world == rank; once all succeeded (one
all-reduce of a failure flag, so a failed rank stops them all), rank 0 writes the index, config.json and tokenizer
and renames the staging directory onto OUT.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from training.tools.cli import ToolError
from training.tools.export_atomic import check_out, new_staging, publish
from training.tools.export_layout import entries
from training.tools.export_safetensors import Unmapper, plan_shards, write_index, write_shards
from training.tools.export_sources import UniversalSource


def launched_world() -> int:
    """The launcher's world size (1 when `training.export` runs on its own)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def export_ranks(
    tag_dir: str,
    out_dir: str,
    fmt: str,
    overwrite: bool,
    shard_bytes: int,
    source_config: Callable[[str, str], tuple[Any, Any]],
    finish: Callable[[str, Any], None],
) -> str:
    """This rank's part of a launched export (`finish(staging, config)` writes config.json + tokenizer)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(hours=12))  # a K3 conversion takes hours
    rank, world = dist.get_rank(), dist.get_world_size()
    shared: list[Any] = [None]
    if rank == 0:
        try:
            check_out(out_dir, overwrite)
            shared = [new_staging(out_dir)]
        except ToolError as e:
            shared = [("error", str(e))]
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], tuple):
        raise ToolError(shared[0][1])
    staging = shared[0]
    work = os.path.join(staging, ".work")
    error: BaseException | None = None
    config = None
    try:
        if rank == 0:
            config, source = source_config(tag_dir, work)
        if rank != 0 or not isinstance(source, UniversalSource):  # (the conversion's own barrier otherwise)
            dist.barrier()
        if rank != 0:
            config, source = source_config(tag_dir, work)
        shards = plan_shards(entries(config, source, fmt, tag_dir), shard_bytes)
        write_shards(staging, shards, rank, world, after_each=Unmapper(source.release))
    except Exception as e:  # noqa: BLE001 - every rank must reach the all-reduce below
        error = e
    failed = torch.tensor([0 if error is None else rank + 1])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if int(failed):
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        if error is not None:
            raise error
        raise ToolError(f"export rank {int(failed) - 1} of {world} failed (its error is in its log); nothing written")
    if rank == 0:
        write_index(staging, shards)  # last: every rank's shards are on disk
        shutil.rmtree(work, ignore_errors=True)
        finish(staging, config)
        publish(staging, os.path.abspath(out_dir))
    dist.barrier()  # every rank returns once OUT exists
    return out_dir
