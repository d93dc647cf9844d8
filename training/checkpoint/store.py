"""Checkpoints that survive crashes and resume bitwise.

Layout of `<run_dir>/checkpoints/`:
    step_00000100/            DeepSpeed tag dir (model/optimizer/ZeRO shards, LR scheduler, client state)
        rank_00000.pt ...     every rank's own state: torch/numpy/python RNG, data-loader state
        trainer_state.json    step, tokens seen, W&B run id, world size, run identity + schedule horizon (rank 0)
        config.json           the model config (so export needs nothing else); tokenizer files
        COMPLETE              written by rank 0 after a barrier: every rank finished writing
    latest                    the newest COMPLETE tag, replaced atomically (tmp file + os.replace)
    best, best.json           checkpoint.keep_best: the best-scoring tag, never pruned (training/checkpoint/best.py)

A crash mid-write leaves a tag dir without COMPLETE; `latest` still names the previous good one, and
`training.checkpoint.resume.find_latest` only returns the COMPLETE tag `latest` names, so the last good checkpoint is
never lost. Keep-last-N prunes only COMPLETE dirs older than the one just committed (never that one).

`save` takes an `on_phase(phase, step)` seam called at each phase of the write (`SAVE_PHASES`): the trainer routes
it to its callbacks, so a test-only fault injector can kill a rank at an exact point without this module knowing.
"""

from __future__ import annotations

import glob
import io
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from data.files import atomic_write
from training.checkpoint.safe_load import safe_torch_load
from training.distributed import barrier

TAG_RE = re.compile(r"^step_(\d{8})$")
COMPLETE = "COMPLETE"
LATEST = "latest"
BEST = "best"  # checkpoint.keep_best's marker (training/checkpoint/best.py)
TRAINER_STATE = "trainer_state.json"
SAVE_PHASES = ("begin", "after_engine_save", "after_rank_file", "before_complete", "before_latest", "before_prune")
# DeepSpeed-MoE writes one file per (layer, global expert id) under ZeRO 1/2 (engine._save_moe_checkpoint)
EXPERT_FILES_GLOB = "layer_*_expert_*_model_states.pt"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(tag_dir: str) -> bool:
    return os.path.isfile(os.path.join(tag_dir, COMPLETE))


def rng_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()  # plain types: loadable with weights_only=True
    st = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    name, keys, pos, has_gauss, gauss = st["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def complete_tags(root: str) -> list[str]:
    """COMPLETE tag names under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if TAG_RE.match(d) and is_complete(os.path.join(root, d)))


PhaseHook = Callable[[str, int], None]


def _no_phase(phase: str, step: int) -> None:
    pass


def save(
    engine,
    root: str,
    step: int,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    rank: int,
    keep_last: int,
    extra_files: Callable[[str], None] | None = None,
    client_extra: dict[str, Any] | None = None,
    on_phase: PhaseHook = _no_phase,
    exclude_frozen: bool = False,
) -> str:
    """Collective: every rank calls it. Returns the committed tag dir.

    `exclude_frozen` (LoRA): the frozen base stays out of the shards (DeepSpeed's exclude_frozen_parameters).

    `extra_files(tag_dir)` runs on rank 0 before COMPLETE (model config.json, tokenizer).
    """
    tag = tag_for(step)
    tag_dir = os.path.join(root, tag)
    on_phase("begin", step)
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.isdir(tag_dir):  # a crashed earlier write of the same step: never half-overwrite
            shutil.rmtree(tag_dir)
    barrier()
    engine.save_checkpoint(
        root,
        tag=tag,
        client_state={"trainer_state": trainer_state, **(client_extra or {})},
        save_latest=False,
        exclude_frozen_parameters=exclude_frozen,
    )
    on_phase("after_engine_save", step)
    rank_path = os.path.join(tag_dir, f"rank_{rank:05d}.pt")
    buf = io.BytesIO()
    torch.save(rank_state, buf)
    atomic_write(rank_path, buf.getvalue())
    on_phase("after_rank_file", step)
    barrier()  # every rank has written its shards and its rank file
    if rank == 0:
        if extra_files is not None:
            extra_files(tag_dir)
        atomic_write(os.path.join(tag_dir, TRAINER_STATE), json.dumps(trainer_state, indent=2) + "\n")
        on_phase("before_complete", step)
        atomic_write(os.path.join(tag_dir, COMPLETE), "")
        on_phase("before_latest", step)
        write_latest(root, tag)
        on_phase("before_prune", step)
        _prune(root, keep_last, keep=tag)
    barrier()
    return tag_dir


def write_latest(root: str, tag: str) -> None:
    """Point `latest` at `tag` (atomic replace): the one authority on which checkpoint a run continues from."""
    atomic_write(os.path.join(root, LATEST), tag)


def _prune(root: str, keep_last: int, keep: str) -> None:
    """Keep the newest `keep_last` COMPLETE checkpoints up to `keep` (the one `latest` now names, never deleted),
    delete older ones and incomplete dirs older than `keep`. Tags newer than `keep` (orphans of an abandoned
    trajectory) are left alone: a later save of that step replaces them. Corrupt ones were moved aside at resume
    (`step_X.corrupt`), so they never count as kept."""
    tags = [t for t in complete_tags(root) if t <= keep]
    best = _best_tag(root)  # checkpoint.keep_best: never pruned (training/checkpoint/best.py)
    for old in tags[:-keep_last]:
        if old not in (keep, best):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    for d in os.listdir(root):
        if TAG_RE.match(d) and d < keep and not is_complete(os.path.join(root, d)):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def _best_tag(root: str) -> str | None:
    """The tag the `best` marker names (checkpoint.keep_best), or None."""
    try:
        with open(os.path.join(root, BEST), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def has_expert_files(tag_dir: str) -> bool:
    """True for checkpoints written with DeepSpeed-MoE expert files (expert parallelism)."""
    return bool(glob.glob(os.path.join(tag_dir, EXPERT_FILES_GLOB)))


def load(
    engine, tag_dir: str, rank: int, world_size: int, ep_load=None, frozen_excluded: bool = False
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Collective. Restores engine (weights, buffers such as router biases, optimizer, LR schedule).

    Returns (trainer_state, this rank's state or None when the world size changed: then RNG is not restored and
    the data loader re-splits from rank 0's state, which describes the global position). `ep_load` replaces
    engine.load_checkpoint under expert parallelism. `frozen_excluded` (LoRA): the shards lack the frozen base,
    which the model already holds (read from model.init_from), so the module state loads non-strictly.
    """
    root, tag = os.path.split(tag_dir.rstrip("/"))
    kw: dict[str, Any] = dict(load_optimizer_states=True, load_lr_scheduler_states=True)
    if frozen_excluded:
        kw["load_module_strict"] = False
    if ep_load is not None:  # any-layout load (training/parallelize.py, training/parallel/checkpoint.py)
        path, client, _ = ep_load(engine, root, tag, **kw)
    else:
        path, client = engine.load_checkpoint(root, tag=tag, **kw)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {tag_dir}")
    with open(os.path.join(tag_dir, TRAINER_STATE), encoding="utf-8") as f:
        trainer_state = json.load(f)
    same_world = int(trainer_state.get("world_size", -1)) == world_size
    own = os.path.join(tag_dir, f"rank_{rank:05d}.pt")
    src = own if same_world else os.path.join(tag_dir, "rank_00000.pt")
    rank_state = safe_torch_load(src)  # untrusted input: never unpickles code
    if not same_world:
        rank_state = {"data": rank_state.get("data"), "rng": None}
    return trainer_state, rank_state
