"""Export a training checkpoint (any ZeRO stage) as a consolidated HF checkpoint.

    python -m training.export <run_dir | run_dir/checkpoints | checkpoint step dir> <out_dir>
    python -m training.export checkpoint=runs/smoke out=runs/smoke-hf
    python -m training.export <lora run> <out_dir> --adapters   (finetune=lora: PEFT adapter files)
    python -m training.export <lora run> <out_dir> --merge      (finetune=lora: base + merged adapters, HF)

ZeRO 1-3: the fp32 master weights are gathered from every rank's shards with DeepSpeed's zero_to_fp32
utilities (buffers such as the router biases come from the model-states file); ZeRO 0: the module state file is
already whole. Expert-parallel checkpoints (per-expert files) are consolidated by training/ep. The model config and
tokenizer saved with the checkpoint travel along, so `model.load_hf_checkpoint(out_dir)` is all a reader needs.
A multimodal run (vision tensors in its state) exports a K3ForConditionalGeneration in the release's names; a run
whose config has a tower but whose state holds none (the text model was trained) exports text-only, said in one line.
"""

from __future__ import annotations

import glob
import os
import sys

import torch

from data import DataError, load_tokenizer
from model import K3Config, build_model, save_hf_checkpoint
from model.hf import VISION_PREFIXES
from model.lora import merge_lora
from training.checkpoint import has_expert_files, resolve_checkpoint, verify_checkpoint
from training.lora import read_adapter_record, read_adapter_weights
from training.parallel.universal import consolidated_state_dict as zero3_state_dict
from training.parallel.universal import is_zero3_checkpoint
from training.tools.cli import ToolError, parse_args, run_tool
from training.tools.export_lora import lora_model, write_adapters


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


def export_checkpoint(path: str, out_dir: str, adapters: bool = False, merge: bool = False) -> str:
    """Write config.json + safetensors (+ tokenizer) for the checkpoint at `path`; returns out_dir. LoRA
    checkpoints: `adapters` writes PEFT's adapter files instead; `merge` (or neither) the merged full model."""
    if adapters and merge:
        raise ToolError("--adapters and --merge exclude each other; pick one")
    model, tag_dir = load_checkpoint_model(path)
    record = read_adapter_record(tag_dir)
    if (adapters or merge) and record is None:
        raise ToolError(f"{tag_dir} is not a finetune=lora checkpoint; export it without --adapters/--merge")
    if adapters:
        return write_adapters(model, record, out_dir)
    if record is not None:
        merge_lora(model)
    save_hf_checkpoint(model, out_dir)
    try:  # the tokenizer saved with the checkpoint travels along, whatever its kind
        load_tokenizer(tag_dir).save(out_dir)
    except DataError:
        pass  # a checkpoint without a tokenizer (e.g. written by a library user): weights only
    return out_dir


def _main(argv: list[str]) -> int:
    flags = {f for f in argv if f.startswith("--")}
    unknown = flags - {"--adapters", "--merge"}
    if unknown:
        raise ToolError(f"unknown flag {sorted(unknown)[0]}; the flags are --adapters and --merge")
    a = parse_args(
        [x for x in argv if x not in flags],
        {"checkpoint": None, "out": None},
        positional=("checkpoint", "out"),
        kinds={"checkpoint": str, "out": str},
    )
    out = export_checkpoint(a["checkpoint"], a["out"], adapters="--adapters" in flags, merge="--merge" in flags)
    print(f"exported {a['checkpoint']} -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool(_main, argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
