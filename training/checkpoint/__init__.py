"""Checkpoints: crash-safe layout and save/load (`store`), untrusted-input loading (`safe_load`), the run identity
(`identity`) and the resume policy (`resume`). Import order is one way: resume -> identity, store -> safe_load."""

from training.checkpoint.identity import ALLOWABLE, ResumePlan, RunMismatch, apply_plan, run_identity
from training.checkpoint.resume import (
    find_latest,
    orphans,
    pick_resume,
    plan_for,
    preflight,
    resolve_checkpoint,
    resume_dir,
    settle,
)
from training.checkpoint.safe_load import CheckpointError, safe_torch_load, verify_checkpoint
from training.checkpoint.store import (
    EXPERT_FILES_GLOB,
    SAVE_PHASES,
    complete_tags,
    has_expert_files,
    is_complete,
    load,
    rng_state,
    save,
    set_rng_state,
    tag_for,
)

__all__ = [
    "ALLOWABLE",
    "CheckpointError",
    "EXPERT_FILES_GLOB",
    "ResumePlan",
    "RunMismatch",
    "SAVE_PHASES",
    "apply_plan",
    "complete_tags",
    "find_latest",
    "has_expert_files",
    "is_complete",
    "load",
    "orphans",
    "pick_resume",
    "plan_for",
    "preflight",
    "resolve_checkpoint",
    "resume_dir",
    "rng_state",
    "run_identity",
    "safe_torch_load",
    "save",
    "set_rng_state",
    "settle",
    "tag_for",
    "verify_checkpoint",
]
