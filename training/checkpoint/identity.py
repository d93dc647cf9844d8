"""Run identity: the fingerprint that says whether a checkpoint belongs to the run being started.

A checkpoint's trainer_state.json holds `run_identity`, flat `key -> value` pairs of everything that defines the
run (resolved model config, the data config's stream-defining part, optimizer and schedule sections, train.seed,
train.seq_len, train.steps and the global batch in rows), so a mismatch can name the keys. Resume continues only
when they agree; `checkpoint.allow_changes` admits the changes that have a defined meaning (ALLOWABLE). The world
size is deliberately absent: the same global batch at another world size is the same run.

Schedule policy for `train.steps`: the LR schedule keeps the horizon it was started with (`schedule_horizon` in
trainer state) and stays at its final value after it, so more steps continue at the schedule's floor and fewer
steps stop early on the original curve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from data.config import DataError, coerce_config, stream_dict
from model.config import K3Config
from training.checkpoint.safe_load import CheckpointError
from training.config import global_batch_rows

IDENTITY_KEY = "run_identity"
HORIZON_KEY = "schedule_horizon"
ALLOWABLE = {
    "train.steps": "more or fewer steps: the LR schedule keeps its original horizon, then stays at its final value",
    "data": "new data sources/settings: the loader starts a fresh data position",
    "optim.lr": "a new peak lr (fine-tuning): the schedule's multiplier continues, scaled to the new lr",
}
_SHOW = 6  # keys named in a refusal line before "+N more"


class RunMismatch(CheckpointError):
    """The checkpoint belongs to another run (or the requested changes are not allowed); one line, exit 2."""


def _flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = obj


def _section(cfg: DictConfig, name: str) -> dict[str, Any]:
    return OmegaConf.to_container(cfg[name], resolve=True, enum_to_str=True)  # type: ignore[return-value]


def run_identity(cfg: DictConfig, mcfg: K3Config, world_size: int) -> dict[str, Any]:
    """Flat fingerprint of the run `cfg` defines (JSON-normalised, so it compares equal to a stored one)."""
    out: dict[str, Any] = {}
    _flatten("model", dataclasses.asdict(mcfg), out)
    _flatten("data", stream_dict(coerce_config(OmegaConf.to_object(cfg.data))), out)
    _flatten("optim", _section(cfg, "optim"), out)
    _flatten("schedule", _section(cfg, "schedule"), out)
    for k in ("seed", "seq_len", "steps"):
        out[f"train.{k}"] = int(cfg.train[k])
    out["train.global_batch_rows"] = int(global_batch_rows(cfg, world_size))
    if str(cfg.get("finetune", "none")) == "lora":  # adapters only: the base they adapt is part of the run
        from training.lora import base_identity

        out["finetune"] = "lora"
        _flatten("lora", _section(cfg, "lora"), out)
        out.update(base_identity(str(cfg.model.init_from)))
        # LoRA checkpoints resume at their own layout only (no universal conversion of adapter shards)
        out["layout.world_size"] = int(world_size)
        out["layout.ep_size"] = int(cfg.parallel.ep_size)
        out["layout.zero_stage"] = int(cfg.deepspeed.zero_stage)
    return json.loads(json.dumps(out, default=str))


def stored_identity(tag_dir: str, state: dict[str, Any]) -> dict[str, Any]:
    """The identity a checkpoint recorded; for one written before identities existed, what can be rebuilt
    (model config from its config.json, the global batch) -- only those keys are then compared."""
    if isinstance(state.get(IDENTITY_KEY), dict):
        return state[IDENTITY_KEY]
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):  # no readable config.json: the global batch alone
        _flatten("model", dataclasses.asdict(K3Config.from_hf_config(tag_dir)), out)
    if "global_batch_rows" in state:
        out["train.global_batch_rows"] = int(state["global_batch_rows"])
    return json.loads(json.dumps(out, default=str))


def allowed(key: str, allow: list[str]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allow)


def check_allow_changes(allow: list[str]) -> list[str]:
    bad = [a for a in allow if a not in ALLOWABLE]
    if bad:
        raise RunMismatch(
            f"checkpoint.allow_changes: {bad[0]!r} is not a change a resumed run can make; choose "
            f"from [{','.join(ALLOWABLE)}] (anything else needs a new run_dir)"
        )
    return list(allow)


_ABSENT = object()  # a key one identity has and the other lacks


def _fmt(v: Any) -> str:
    return "<absent>" if v is _ABSENT else json.dumps(v)


@dataclass
class ResumePlan:
    """What a resume does beyond restoring the checkpoint: the schedule horizon and which allowed changes apply."""

    identity: dict[str, Any]
    horizon: int
    changed: list[str] = field(default_factory=list)  # allowed keys that differ from the checkpoint
    allow: list[str] = field(default_factory=list)

    @property
    def fresh_data(self) -> bool:
        return any(allowed(k, ["data"]) for k in self.changed)

    @property
    def new_lr(self) -> bool:
        return "optim.lr" in self.changed

    def state(self) -> dict[str, Any]:
        """Entries for trainer_state.json."""
        return {IDENTITY_KEY: self.identity, HORIZON_KEY: self.horizon}


def plan_resume(
    identity: dict[str, Any], state: dict[str, Any] | None, tag_dir: str | None, allow: list[str], run_dir: str
) -> ResumePlan:
    """The plan for resuming `tag_dir` (trainer state `state`) as the run `identity`; raises RunMismatch (one
    line naming the keys that differ, old -> new, and the choices) unless every difference is allowed."""
    steps = int(identity["train.steps"])
    if state is None or tag_dir is None:
        return ResumePlan(identity, steps, allow=allow)
    old = stored_identity(tag_dir, state)
    keys = sorted(set(old) | set(identity)) if IDENTITY_KEY in state else sorted(set(old) & set(identity))
    diff = [k for k in keys if old.get(k, _ABSENT) != identity.get(k, _ABSENT)]
    tag = os.path.basename(tag_dir.rstrip("/"))
    fixed = [k for k in diff if not allowed(k, allow)]
    if fixed:
        shown = ", ".join(f"{k} {_fmt(old.get(k, _ABSENT))} -> {_fmt(identity.get(k, _ABSENT))}" for k in fixed[:_SHOW])
        more = f" (+{len(fixed) - _SHOW} more)" if len(fixed) > _SHOW else ""
        can = sorted({a for k in fixed for a in ALLOWABLE if allowed(k, [a])})
        if all(any(allowed(k, [a]) for a in ALLOWABLE) for k in fixed):
            choices = f"or checkpoint.allow_changes=[{','.join(can)}] to continue it with these changes"
        else:
            choices = "or checkpoint.start_over=true to archive the old run and start fresh"
        raise RunMismatch(
            f"run_dir {run_dir} holds another run: its checkpoint {tag} differs in {shown}{more}; "
            f"use a new run_dir=, {choices}"
        )
    horizon = int(state.get(HORIZON_KEY, old.get("train.steps", steps)))
    return ResumePlan(identity, horizon, diff, allow)


def _retarget_lr(scheduler: Any, base_lrs: list[float]) -> None:
    """The config's peak lr replaces the checkpoint's; the schedule's multiplier at this step is kept."""
    scheduler.base_lrs = list(base_lrs)
    lrs = [b * f(scheduler.last_epoch) for b, f in zip(base_lrs, scheduler.lr_lambdas)]
    for g, b, lr in zip(scheduler.optimizer.param_groups, base_lrs, lrs):
        g["initial_lr"], g["lr"] = b, lr
    scheduler._last_lr = lrs


def apply_plan(
    plan: ResumePlan,
    loader: Any,
    data_state: dict[str, Any] | None,
    scheduler: Any,
    base_lrs: list[float],
    is_main: bool,
) -> None:
    """After the engine restored the checkpoint: the data position (or a fresh one for changed data) and the
    new peak lr (`base_lrs`: the freshly built scheduler's, taken before the load)."""
    fresh = plan.fresh_data
    if data_state is not None and not fresh:
        try:
            loader.load_state_dict(data_state)
        except DataError as e:
            if "fingerprint" not in str(e):
                raise CheckpointError(f"cannot continue this checkpoint's data position: {e}") from None
            if "data" not in plan.allow:
                raise CheckpointError(
                    "the data (files, tokenizer) changed since this checkpoint was written; use "
                    "checkpoint.allow_changes=[data] to continue at a fresh data position, or a "
                    "new run_dir="
                ) from None
            fresh = True
    if fresh and is_main:
        print("checkpoint.allow_changes=[data]: the data changed, the loader starts a fresh data position", flush=True)
    if plan.new_lr and scheduler is not None:
        _retarget_lr(scheduler, base_lrs)
