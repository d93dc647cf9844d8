"""Which checkpoint a run resumes from: the newest complete one `latest` names, verified before use.

Policy (one place): `checkpoint.resume=auto` takes the tag `latest` names when it is complete (a crash between
COMPLETE and the marker leaves a newer complete tag: that one wins); `none` starts fresh; a path resumes from that
checkpoint. With `checkpoint.fallback=true` a checkpoint that fails verification (corrupted, truncated, pickled
code) falls back to the newest older complete one that verifies.
"""
from __future__ import annotations

import os

from training.checkpoint.safe_load import CheckpointError, verify_checkpoint
from training.checkpoint.store import LATEST, complete_tags, is_complete


def find_latest(root: str) -> str | None:
    """The newest COMPLETE checkpoint dir under `root` (prefers the `latest` marker), or None."""
    tags = complete_tags(root)
    marker = os.path.join(root, LATEST)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            tag = f.read().strip()
        if tag and is_complete(os.path.join(root, tag)) and not (tags and tags[-1] > tag):
            return os.path.join(root, tag)
    return os.path.join(root, tags[-1]) if tags else None


def resolve_checkpoint(path: str) -> str:
    """Accept a tag dir, a checkpoints/ dir or a run dir; return a COMPLETE tag dir or raise one line."""
    path = os.path.abspath(path)
    if is_complete(path):
        return path
    for root in (path, os.path.join(path, "checkpoints")):
        found = find_latest(root)
        if found:
            return found
    raise FileNotFoundError(f"no complete checkpoint at {path}; pass a run dir, its checkpoints/ or a step_* dir")


def pick_resume(found: str | None, fallback: bool, is_main: bool) -> str | None:
    """`found` if it verifies; with `fallback`, else the newest older complete checkpoint that does."""
    if found is None:
        return None
    root, tag = os.path.split(found.rstrip("/"))
    older = [os.path.join(root, t) for t in reversed(complete_tags(root)) if t < tag] if fallback else []
    for cand in [found, *older]:
        try:
            verify_checkpoint(cand)
            return cand
        except CheckpointError as e:
            if not fallback:
                raise
            if is_main:
                print(f"warning: {e}; falling back to the previous checkpoint", flush=True)
    raise CheckpointError(f"no usable checkpoint under {root} (every complete one failed verification); "
                          "start fresh with checkpoint.resume=none or a new run_dir")


def resume_dir(resume: str, ckpt_root: str, fallback: bool, is_main: bool) -> str | None:
    """The checkpoint to resume from for `checkpoint.resume` (auto | none | <path>), or None for a fresh start."""
    if resume == "none":
        return None
    found = find_latest(ckpt_root) if resume == "auto" else resolve_checkpoint(resume)
    return pick_resume(found, fallback, is_main)
