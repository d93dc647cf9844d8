"""Export a training checkpoint (any ZeRO stage, expert files, LoRA, vision) as a HF checkpoint, streamed.

    python -m training.export <run_dir | run_dir/checkpoints | checkpoint step dir | HF dir> <out_dir>
    python -m training.export checkpoint=runs/smoke out=runs/smoke-hf
    python -m training.export <run> <out_dir> --format release  (MXFP4 experts, bf16, the release's config)
    python -m training.export <run> <out_dir> --overwrite       (replace a non-empty out_dir, atomically)
    python -m training.export <run> <out_dir> --procs 4         (4 processes write disjoint shards)
    python -m training.export <run> <out_dir> --shard-bytes N   (shards of at most N bytes: 5 GiB, release 16.3 GB)
    torchrun/deepspeed/srun ... -m training.export <run> <out_dir>  (every launched rank writes its share)
    python -m training.export <lora run> <out_dir> --adapters   (finetune=lora: PEFT adapter files)
    python -m training.export <lora run> <out_dir> --merge      (finetune=lora: base + merged adapters, HF)

The export never builds the model: tensors are read one at a time from the checkpoint's own files
(training/tools/export_sources.py: the module file, each rank's ZeRO-1/2 fp32 partitions, DeepSpeed's universal
per-parameter files for ZeRO-3, the per-expert files of expert parallelism; mapped, weights-only) and streamed
into safetensors shards (export_safetensors.py) in the chosen layout (export_layout.py). Everything is written
beside out_dir and renamed onto it at the end (export_atomic.py): a killed export leaves no directory that looks
complete. The model config and tokenizer saved with the checkpoint travel along, so `model.load_hf_checkpoint`
is all a reader needs. A multimodal run (vision tensors in its state) exports a K3ForConditionalGeneration in the
release's names; a run whose config has a tower but whose state holds none exports text-only, said in one line.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import shutil
import sys

import torch

from data import DataError, load_tokenizer
from model import K3Config, build_model
from model.hf import VISION_PREFIXES
from model.vision.multimodal import K3ForConditionalGeneration
from training.checkpoint import has_expert_files, resolve_checkpoint, verify_checkpoint
from training.lora import read_adapter_record, read_adapter_weights
from training.parallel.universal import consolidated_state_dict as zero3_state_dict
from training.parallel.universal import is_zero3_checkpoint
from training.tools.cli import ToolError, parse_args, run_tool
from training.tools.export_atomic import staged_output
from training.tools.export_layout import FORMATS, HF_SHARD_BYTES, RELEASE_SHARD_BYTES, entries, hf_config
from training.tools.export_lora import lora_model, write_adapters
from training.tools.export_lora_merge import LoRAMergeSource
from training.tools.export_ranks import export_ranks, launched_world
from training.tools.export_safetensors import Entry, Unmapper, plan_shards, write_index, write_shards
from training.tools.export_sources import ModuleSource, Source, open_source


def consolidated_state_dict(tag_dir: str) -> dict[str, torch.Tensor]:
    """The full fp32 module state dict of a DeepSpeed checkpoint dir, whatever its ZeRO stage or EP size."""
    verify_checkpoint(
        tag_dir, trainer_state=False
    )  # untrusted: every file must load weights-only before DeepSpeed's loaders see it
    root, tag = os.path.split(os.path.abspath(tag_dir))
    if has_expert_files(tag_dir):  # (DeepSpeed is imported only for the checkpoints that need it: start-up time)
        from training.parallel.ds_moe import consolidated_module_state

        return consolidated_module_state(tag_dir)
    if is_zero3_checkpoint(tag_dir):  # zero3_partitioned (AutoEP experts): DeepSpeed's universal conversion
        return zero3_state_dict(tag_dir)
    if glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        out = dict(get_fp32_state_dict_from_zero_checkpoint(root, tag=tag))
        # ZeRO-1 saves no frozen_param_fragments (engine: only when partitioning gradients), so zero_to_fp32 drops
        # frozen parameters (train.freeze); below ZeRO-3 the model-states module is whole: take them from there
        whole = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
        if os.path.isfile(whole):
            module = torch.load(whole, map_location="cpu", weights_only=True)["module"]  # (verified above)
            out.update({k: v for k, v in module.items() if k not in out})
        return out
    files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
    if not files:
        raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states; is it a checkpoint step dir?")
    return torch.load(files[0], map_location="cpu", weights_only=True)["module"]  # (verified above)


def load_checkpoint_model(path: str):
    """The model (K3ForCausalLM, or K3ForConditionalGeneration when the state holds the tower) with the weights
    of the newest complete checkpoint under `path` (fp32, CPU); for a LoRA checkpoint the base + its adapters
    (training/tools/export_lora.py)."""
    tag_dir = resolve_checkpoint(path)
    record = read_adapter_record(tag_dir)
    if record is not None:  # adapters only, written whole beside DeepSpeed's shards (training/lora.py)
        return lora_model(record, read_adapter_weights(tag_dir)), tag_dir
    config = K3Config.from_hf_config(tag_dir)
    state = consolidated_state_dict(tag_dir)
    if config.vision_config is not None and not any(k.startswith(VISION_PREFIXES) for k in state):
        print(
            f"export: {tag_dir} holds no vision tensors (the text model was trained); writing a text-only checkpoint",
            file=sys.stderr,
        )
        config = config.text_only()
    model = build_model(config)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    return model.eval(), tag_dir


def _is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and bool(glob.glob(os.path.join(path, "*.safetensors")))


def _write(
    staging: str, config: K3Config, source: Source, fmt: str, where: str, max_shard_bytes: int | None
) -> list[list[Entry]]:
    """config.json + the shards (one process), the index last."""
    shards = plan_shards(entries(config, source, fmt, where), max_shard_bytes or _shard_bytes(fmt))
    write_shards(staging, shards, after_each=Unmapper(source.release))  # the pages a tensor mapped leave the process
    write_index(staging, shards)
    return shards


def _shard_bytes(fmt: str) -> int:
    return RELEASE_SHARD_BYTES if fmt == "release" else HF_SHARD_BYTES


def _save_config(staging: str, config: K3Config, fmt: str) -> None:
    with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(config, fmt), f, indent=2, sort_keys=True)
        f.write("\n")


def _copy_tokenizer(src_dir: str, staging: str) -> None:
    try:  # the tokenizer (and its chat template) saved with the checkpoint travels along, whatever its kind
        load_tokenizer(src_dir).save(staging)
    except DataError:
        pass  # a checkpoint without a tokenizer (e.g. written by a library user): weights only


def export_model(
    model: torch.nn.Module,
    out_dir: str,
    fmt: str = "hf",
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
    tokenizer_dir: str | None = None,
) -> str:
    """Write a model held in memory (e.g. `load_hf_checkpoint(...)`) in layout `fmt`, atomically; returns out_dir."""
    with staged_output(out_dir, overwrite) as staging:
        config = model.config
        if not isinstance(model, K3ForConditionalGeneration) and config.vision_config is not None:
            config = config.text_only()
        _write(staging, config, ModuleSource(model), fmt, "<module>", max_shard_bytes)
        _save_config(staging, config, fmt)
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, staging)
    return out_dir


def _source_config(tag_dir: str, work: str) -> tuple[K3Config, Source]:
    config = K3Config.from_hf_config(tag_dir)
    source = open_source(tag_dir, work)
    if config.vision_config is not None and not any(k.startswith(VISION_PREFIXES) for k in source.names()):
        print(
            f"export: {tag_dir} holds no vision tensors (the text model was trained); writing a text-only checkpoint",
            file=sys.stderr,
        )
        config = config.text_only()
    return config, source


def _write_part(tag_dir: str, work: str, fmt: str, shard_bytes: int, staging: str, rank: int, procs: int) -> None:
    """One process of a parallel export: the shards i % procs == rank (the plan is the same in every process)."""
    config, source = _source_config(tag_dir, work)
    shards = plan_shards(entries(config, source, fmt, tag_dir), shard_bytes)
    write_shards(staging, shards, rank, procs, after_each=Unmapper(source.release))


def export_checkpoint(
    path: str,
    out_dir: str,
    adapters: bool = False,
    merge: bool = False,
    fmt: str = "hf",
    overwrite: bool = False,
    procs: int = 1,
    max_shard_bytes: int | None = None,
    launched: bool = False,
) -> str:
    """Write config.json + safetensors (+ tokenizer) for the checkpoint at `path` in layout `fmt` ("hf" |
    "release"), streamed and atomically; returns out_dir. LoRA checkpoints: `adapters` writes PEFT's adapter files
    instead; `merge` (or neither) the merged full model. `procs` > 1 writes disjoint shards from that many
    processes. `launched`: this process is one of a launcher's ranks and every rank calls this (the CLI under
    torchrun/deepspeed/srun); a library caller that is itself a rank of some job (training.evaluate's rank 0)
    keeps the default and exports alone."""
    if adapters and merge:
        raise ToolError("--adapters and --merge exclude each other; pick one")
    if fmt not in FORMATS:
        raise ToolError(f"unknown --format {fmt!r}; the formats are {', '.join(FORMATS)}")
    if procs < 1:
        raise ToolError(f"--procs {procs} must be at least 1")
    hf_dir = os.path.abspath(path) if _is_hf_dir(path) else None
    tag_dir = hf_dir or resolve_checkpoint(path)
    record = None if hf_dir else read_adapter_record(tag_dir)
    if (adapters or merge) and record is None:
        raise ToolError(f"{tag_dir} is not a finetune=lora checkpoint; export it without --adapters/--merge")
    if record is not None and adapters:  # adapters only, written whole beside DeepSpeed's shards (training/lora.py)
        model = lora_model(record, read_adapter_weights(tag_dir))
        with staged_output(out_dir, overwrite) as staging:
            write_adapters(model, record, staging)
        return out_dir
    if record is not None:  # the base streamed from model.init_from, merged tensor by tensor
        with staged_output(out_dir, overwrite) as staging:
            source = LoRAMergeSource(record, tag_dir)
            config = K3Config.from_hf_config(record["base.path"])
            _write(staging, config, source, fmt, tag_dir, max_shard_bytes)
            _save_config(staging, config, fmt)
            _copy_tokenizer(tag_dir, staging)
        return out_dir
    if launched:  # started by a launcher: every rank writes its share of the shards

        def finish(staging: str, config: K3Config) -> None:
            _save_config(staging, config, fmt)
            _copy_tokenizer(tag_dir, staging)

        shard_bytes = max_shard_bytes or _shard_bytes(fmt)
        return export_ranks(tag_dir, out_dir, fmt, overwrite, shard_bytes, _source_config, finish)
    with staged_output(out_dir, overwrite) as staging:
        work = os.path.join(staging, ".work")  # ZeRO-3's universal conversion; removed before the rename
        config, source = _source_config(tag_dir, work)
        shard_bytes = max_shard_bytes or _shard_bytes(fmt)
        if procs == 1:
            _write(staging, config, source, fmt, tag_dir, shard_bytes)
        else:
            shards = plan_shards(entries(config, source, fmt, tag_dir), shard_bytes)
            # fork where the OS has it (the children inherit the imports: no start-up), else spawn; this process
            # writes rank 0's shards itself
            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            args = (tag_dir, work, fmt, shard_bytes, staging)
            workers = [ctx.Process(target=_write_part, args=(*args, r, procs)) for r in range(1, procs)]
            for w in workers:
                w.start()
            _write_part(*args, 0, procs)
            for w in workers:
                w.join()
            failed = [r + 1 for r, w in enumerate(workers) if w.exitcode != 0]
            if failed:
                raise ToolError(f"export process {failed[0]} of {procs} failed (see its error above); nothing written")
            write_index(staging, shards)  # last: every shard is on disk
        shutil.rmtree(work, ignore_errors=True)
        _save_config(staging, config, fmt)
        _copy_tokenizer(tag_dir, staging)
    return out_dir


_VALUED = ("--format", "--procs", "--shard-bytes")


def _main(argv: list[str]) -> int:
    args: list[str] = []
    values: dict[str, str] = {}
    it = iter(argv)
    for a in it:
        flag, eq, val = a.partition("=")
        if flag in _VALUED:
            values[flag] = val if eq else next(it, "")
        else:
            args.append(a)
    flags = {f for f in args if f.startswith("--")}
    unknown = flags - {"--adapters", "--merge", "--overwrite"}
    if unknown:
        raise ToolError(
            f"unknown flag {sorted(unknown)[0]}; the flags are --adapters, --merge, --overwrite, --format, --procs, "
            "--shard-bytes"
        )
    a = parse_args(
        [x for x in args if x not in flags],
        {"checkpoint": None, "out": None},
        positional=("checkpoint", "out"),
        kinds={"checkpoint": str, "out": str},
    )
    procs, shard_bytes = values.get("--procs", "1"), values.get("--shard-bytes", "0")
    for flag, v in (("--procs", procs), ("--shard-bytes", shard_bytes)):
        if not v.isdigit():
            raise ToolError(f"{flag} {v!r} must be a positive integer")
    out = export_checkpoint(
        a["checkpoint"],
        a["out"],
        adapters="--adapters" in flags,
        merge="--merge" in flags,
        fmt=values.get("--format", "hf"),
        overwrite="--overwrite" in flags,
        procs=int(procs),
        max_shard_bytes=int(shard_bytes) or None,
        launched=launched_world() > 1,
    )
    print(f"exported {a['checkpoint']} -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool(_main, argv, __doc__ or "")


if __name__ == "__main__":
    from training.distributed import leave

    sys.exit(leave(main()))  # a launched rank ends without interpreter teardown (training/distributed.py)
