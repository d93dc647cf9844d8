"""Which checkpoint a run resumes from, and whether it may: `latest` is the authority, the run must be the same.

Policy (one place): `checkpoint.resume=auto` takes the tag `latest` names; a COMPLETE checkpoint newer than
`latest` is an orphan (an abandoned trajectory, or a crash between COMPLETE and the marker) and is never picked.
Without a marker (a run whose first marker write crashed) the newest COMPLETE tag is used. `none` starts fresh, a
path resumes from that checkpoint. With `checkpoint.fallback=true` a checkpoint that fails verification
(corrupted, truncated, pickled code) falls back to the newest older complete one that verifies; rank 0 moves the
bad one aside as `step_X.corrupt` and rewrites `latest`, so retention (`keep_last`) never counts it as a good one.

`preflight` runs on rank 0 before anything is written: it refuses (one line, RunMismatch) a resume whose run
identity (training/checkpoint/identity.py) differs beyond `checkpoint.allow_changes`, and `resume=none` in a run
directory that holds checkpoints unless `checkpoint.start_over=true`.
"""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig

from model.config import K3Config
from training.checkpoint.identity import (
    IDENTITY_KEY,
    ResumePlan,
    RunMismatch,
    check_allow_changes,
    plan_resume,
    run_identity,
)
from training.checkpoint.safe_load import CheckpointError, verify_checkpoint
from training.checkpoint.store import BEST, LATEST, TRAINER_STATE, complete_tags, is_complete, write_latest

_verified: set[str] = set()  # tag dirs this process already verified (pre-flight, then the trainer: read once)


def _marker(root: str) -> str | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def find_latest(root: str) -> str | None:
    """The COMPLETE checkpoint dir `latest` names under `root` (if it names an incomplete one: the newest
    complete one older than it; without a marker: the newest complete one), or None."""
    tags = complete_tags(root)
    tag = _marker(root)
    if tag is None:
        return os.path.join(root, tags[-1]) if tags else None
    if is_complete(os.path.join(root, tag)):
        return os.path.join(root, tag)
    older = [t for t in tags if t < tag]
    return os.path.join(root, older[-1]) if older else None


def orphans(root: str) -> list[str]:
    """COMPLETE tags newer than the one `latest` names: never resumed."""
    found = find_latest(root)
    cut = os.path.basename(found) if found else ""
    return [t for t in complete_tags(root) if found and t > cut]


def resolve_checkpoint(path: str) -> str:
    """Accept a tag dir, a checkpoints/ dir, a run dir or a `latest` / `best` marker file (checkpoint.keep_best);
    return a COMPLETE tag dir or raise one line."""
    path = os.path.abspath(path)
    if os.path.basename(path) in (LATEST, BEST) and os.path.isfile(path):  # a marker: the tag it names
        path = os.path.join(os.path.dirname(path), open(path, encoding="utf-8").read().strip())
    if is_complete(path):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        found = find_latest(root)
        if found:
            return found
    raise FileNotFoundError(f"no complete checkpoint at {path}; pass a run dir, its checkpoints/ or a step_* dir")


def _move_aside(tag_dir: str) -> str:
    dst, n = tag_dir.rstrip("/") + ".corrupt", 1
    while os.path.exists(dst):
        dst, n = f"{tag_dir.rstrip('/')}.corrupt{n}", n + 1
    os.rename(tag_dir, dst)
    return dst


def pick_resume(found: str | None, fallback: bool, is_main: bool, settle: bool = False) -> str | None:
    """`found` if it verifies; with `fallback`, else the newest older complete checkpoint that does. With
    `settle` (rank 0, before the process group exists) bad ones are moved aside and `latest` names the pick."""
    if found is None:
        return None
    root, tag = os.path.split(found.rstrip("/"))
    older = [os.path.join(root, t) for t in reversed(complete_tags(root)) if t < tag] if fallback else []
    moved = False
    for cand in [found, *older]:
        try:
            if cand not in _verified:
                verify_checkpoint(cand)
                _verified.add(cand)
        except CheckpointError as e:
            if not fallback:
                raise
            if settle:
                print(
                    f"warning: {e}; moved it aside to {_move_aside(cand)}, falling back to the previous checkpoint",
                    flush=True,
                )
                moved = True
            elif is_main:
                print(f"warning: {e}; falling back to the previous checkpoint", flush=True)
            continue
        if moved:
            write_latest(root, os.path.basename(cand))
        return cand
    raise CheckpointError(
        f"no usable checkpoint under {root} (every complete one failed verification); "
        "start fresh with a new run_dir or checkpoint.start_over=true"
    )


def resume_dir(resume: str, ckpt_root: str, fallback: bool, is_main: bool) -> str | None:
    """The checkpoint to resume from for `checkpoint.resume` (auto | none | <path>), or None for a fresh start."""
    if resume == "none":
        return None
    found = find_latest(ckpt_root) if resume == "auto" else resolve_checkpoint(resume)
    return pick_resume(found, fallback, is_main)


def read_trainer_state(tag_dir: str) -> dict:
    """trainer_state.json of a checkpoint, or a one-line CheckpointError naming it."""
    path = os.path.join(tag_dir, TRAINER_STATE)
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if not isinstance(state, dict):
            raise ValueError("not a JSON object")
        return state
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint file {path} is missing or corrupted ({type(e).__name__}); resume "
            "from another checkpoint (checkpoint.fallback=true) or use a new run_dir"
        ) from None


def _candidate(cfg: DictConfig, ckpt_root: str) -> tuple[str | None, dict | None]:
    """The checkpoint resume would start from and its trainer state (fallback: the newest readable one)."""
    resume = str(cfg.checkpoint.resume)
    found = find_latest(ckpt_root) if resume == "auto" else resolve_checkpoint(resume)
    if found is None:
        return None, None
    root, tag = os.path.split(found.rstrip("/"))
    cands = [found, *(os.path.join(root, t) for t in reversed(complete_tags(root)) if t < tag)]
    for cand in cands if cfg.checkpoint.fallback else cands[:1]:
        try:
            return cand, read_trainer_state(cand)
        except CheckpointError:
            if not cfg.checkpoint.fallback:
                raise
    return found, None  # nothing readable: pick_resume reports it


def preflight(cfg: DictConfig, mcfg: K3Config, world_size: int, run_dir: str) -> None:
    """Refuse, before anything is written, a job that would mix two runs in `run_dir` (one line, RunMismatch)."""
    allow = check_allow_changes([str(a) for a in cfg.checkpoint.allow_changes])
    resume, ckpt_root = str(cfg.checkpoint.resume), os.path.join(run_dir, "checkpoints")
    held = complete_tags(ckpt_root)
    if cfg.checkpoint.start_over:
        if resume not in ("auto", "none"):
            raise RunMismatch(
                f"checkpoint.start_over=true starts {run_dir} fresh and cannot resume "
                f"checkpoint.resume={resume}; drop one of them"
            )
        return
    if resume == "none":
        if held:
            raise RunMismatch(
                f"run_dir {run_dir} holds checkpoints of an earlier run (up to {held[-1]}) and "
                "checkpoint.resume=none would mix a new run into it; use a new run_dir=, "
                "checkpoint.resume=auto to continue it, or checkpoint.start_over=true to archive it "
                f"under {os.path.join(run_dir, 'archive')}/ and start fresh"
            )
        return
    tag_dir, state = _candidate(cfg, ckpt_root)
    if state is not None:
        plan_resume(run_identity(cfg, tokenizer_media_id(cfg, mcfg, state), world_size), state, tag_dir, allow, run_dir)


def tokenizer_media_id(cfg: DictConfig, mcfg: K3Config, state: dict) -> K3Config:
    """`mcfg` with the checkpoint's `<|media_pad|>` id where the trainer takes it from the tokenizer (a fresh
    vision model without `model.media_placeholder_token_id`: Trainer._media_id), which preflight has not loaded
    yet. The tokenizer itself is compared (data.*), and the trainer's own check (`plan_for`) compares the id it
    then takes."""
    stored = (state.get(IDENTITY_KEY) or {}).get("model.media_placeholder_token_id")
    if mcfg.vision_config is None or cfg.model.media_placeholder_token_id is not None or cfg.model.init_from:
        return mcfg
    return mcfg if stored is None else mcfg.replace(media_placeholder_token_id=int(stored))


def settle(cfg: DictConfig, run_dir: str) -> None:
    """Rank 0, holding the run-dir lock, before the process group: name orphans, move bad checkpoints aside
    (`checkpoint.fallback=true`) so `latest` names the checkpoint every rank will resume."""
    resume, ckpt_root = str(cfg.checkpoint.resume), os.path.join(run_dir, "checkpoints")
    if resume != "auto":
        return
    for t in orphans(ckpt_root):
        print(
            f"warning: {os.path.join(ckpt_root, t)} is newer than `latest` (an orphan of an abandoned or "
            "crashed write); it is never resumed",
            flush=True,
        )
    if cfg.checkpoint.fallback:
        pick_resume(find_latest(ckpt_root), True, True, settle=True)


def plan_for(cfg: DictConfig, mcfg: K3Config, world_size: int, tag_dir: str | None, run_dir: str) -> ResumePlan:
    """The resume plan for the checkpoint every rank picked (None: a fresh start): identity, horizon, changes."""
    allow = check_allow_changes([str(a) for a in cfg.checkpoint.allow_changes])
    state = read_trainer_state(tag_dir) if tag_dir is not None else None
    return plan_resume(run_identity(cfg, mcfg, world_size), state, tag_dir, allow, run_dir)
