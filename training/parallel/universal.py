"""Resume a ZeRO-3 (+ EP) checkpoint at another layout through DeepSpeed's universal checkpoint.

ZeRO-3 checkpoints of AutoEP-presented experts are "zero3_partitioned" (per-rank ZeRO shards, experts inside them,
no per-expert files): DeepSpeed reads them back only at the layout that wrote them (stage3 `_load_zero_checkpoint`).
For another EP size or world size, `python -m deepspeed.checkpoint.ds_to_universal` consolidates them (fp32
weights *and* Adam moments per parameter, experts as one [E, ...] tensor with `is_expert_param`), and an engine
started with `checkpoint.load_universal` re-slices that per rank (stage3 `load_hp_checkpoint_state` ->
`_slice_autoep_universal_expert_param` for AutoEP-tagged experts, a plain 1/W narrow for everything else).
Buffers are not part of the universal format (engine `_load_checkpoint` skips the module state when loading
universal), so the balancer biases are copied from the model-states file here.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import torch
from torch import nn

from training.checkpoint.safe_load import CheckpointError, safe_torch_load, verify_checkpoint
from training.distributed import barrier

UNIVERSAL_DIR = "universal"  # <run_dir>/universal/<tag>: the converted copy of a resumed checkpoint


def is_zero3_checkpoint(tag_dir: str) -> bool:
    """ZeRO-3 checkpoints store one zero_pp_rank_* model-states file per rank and no mp_rank_* file."""
    return bool(glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_*_model_states.pt"))) and not glob.glob(
        os.path.join(tag_dir, "mp_rank_*_model_states.pt")
    )


def model_states_file(tag_dir: str) -> str:
    """The rank-0 model-states file of a checkpoint (ZeRO-3: zero_pp_rank_0_..., otherwise mp_rank_00_...)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(tag_dir, name)):
            return os.path.join(tag_dir, name)
    raise CheckpointError(f"checkpoint {tag_dir} has no model states file; resume from another checkpoint")


def convert(tag_dir: str, run_dir: str, is_main: bool) -> tuple[str, str]:
    """Collective. Rank 0 converts `tag_dir` into <run_dir>/universal/<tag> once (after checking every file loads
    weights-only: ds_to_universal unpickles with weights_only=False). Returns (load_dir, tag) for
    engine.load_checkpoint of an engine configured with `checkpoint.load_universal`."""
    tag = os.path.basename(tag_dir.rstrip("/"))
    out_root = os.path.join(run_dir, UNIVERSAL_DIR)
    out = os.path.join(out_root, tag)
    if is_main and not os.path.isfile(os.path.join(out, "DONE")):
        verify_checkpoint(tag_dir, trainer_state=False)
        os.makedirs(out_root, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            tag_dir,
            "--output_folder",
            out,
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or ["?"])[-1]
            raise CheckpointError(
                f"ds_to_universal could not convert {tag_dir} ({last[:200]}); resume it at the "
                "layout that wrote it (same parallel.ep_size and world size)"
            )
        open(os.path.join(out, "DONE"), "w").close()
    barrier()
    return out_root, tag


def consolidated_state_dict(tag_dir: str) -> dict[str, torch.Tensor]:
    """Full fp32 module state dict (all experts stacked) of a ZeRO-3 checkpoint, whatever its EP size: DeepSpeed's
    universal conversion (into a temporary dir) for the parameters, the model states for the buffers. For export
    (zero_to_fp32 refuses zero3_partitioned checkpoints and points to ds_to_universal)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="k3-export-") as tmp:
        root, tag = convert(tag_dir, tmp, is_main=True)
        zero = os.path.join(root, tag, "zero")
        out: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(zero)):
            path = os.path.join(zero, name, "fp32.pt")
            if os.path.isfile(path):  # written by ds_to_universal from the verified input just now
                t = torch.load(path, map_location="cpu", weights_only=False)
                out[name] = (t["param"] if isinstance(t, dict) else t).detach().clone()
    saved = safe_torch_load(model_states_file(tag_dir))
    shapes = {k: v for group in saved.get("param_shapes") or [] for k, v in group.items()}
    for name, t in out.items():
        if name in shapes and tuple(t.shape) != tuple(shapes[name]) and t.numel() == torch.Size(shapes[name]).numel():
            out[name] = t.view(shapes[name])
    for name in saved.get("buffer_names") or []:
        out[name] = saved["module"][name]
    out.update({k: v for k, v in frozen_params(tag_dir).items() if k not in out})
    return out


def frozen_params(tag_dir: str) -> dict[str, torch.Tensor]:
    """The whole tensors of the parameters no optimizer owns (`train.freeze`) in a ZeRO-3 checkpoint.

    ds_to_universal converts only the optimizer's fp32 partitions, so a frozen tower would be missing from (or,
    frozen whole, silently dropped by) an export. DeepSpeed's contract (engine `_common_checkpoint_state` with
    ZeRO >= 2): each rank's model-states file holds `frozen_param_shapes` (the full shapes) and
    `frozen_param_fragments` (its `ds_tensor`, the 1/W partition over the data-parallel group, padded); the whole
    tensor is the ranks' fragments concatenated in rank order, cut to numel (zero_to_fp32
    `_zero3_merge_frozen_params`, which refuses AutoEP checkpoints)."""
    files = glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_00_model_states.pt"))
    files.sort(key=lambda f: int(os.path.basename(f).split("_")[3]))  # zero_pp_rank_<dp rank>_mp_rank_00_...
    states = [safe_torch_load(f) for f in files]
    shapes = (states[0].get("frozen_param_shapes") or {}) if states else {}
    out = {}
    for name, shape in shapes.items():
        frags = [s["frozen_param_fragments"][name].reshape(-1) for s in states]
        out[name] = torch.cat(frags).narrow(0, 0, torch.Size(shape).numel()).view(tuple(shape)).clone()
    return out


@torch.no_grad()
def restore_buffers(module: nn.Module, tag_dir: str) -> list[str]:
    """Copy persistent buffers (router e_score_correction_bias) from the checkpoint's model states into `module`
    (buffers are replicated, never ZeRO-partitioned). Returns the names restored."""
    saved = safe_torch_load(model_states_file(tag_dir))["module"]
    done = []
    for name, buf in module.named_buffers():
        if name in saved and saved[name].shape == buf.shape:
            buf.copy_(saved[name].to(buf.dtype))
            done.append(name)
    return done
