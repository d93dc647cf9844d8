"""Checkpoints are untrusted input: load them without ever executing pickled code, fail on damage with one line.

DeepSpeed's TorchCheckpointEngine calls `torch.load(..., weights_only=False)`, which runs any pickled callable.
`install(engine)` replaces the engine's checkpoint-engine `load` with `safe_torch_load`: `weights_only=True` plus an
explicit allowlist of the few plain-data classes DeepSpeed stores (loss scaler, ZeRO stage enum, fragment
address), reconstructed by the restricted unpickler without calling code. `verify_checkpoint` checks a tag dir
before anything is loaded (every file present, every .pt readable by the safe loader), so a corrupted, truncated or
malicious checkpoint is reported as one line naming the file, and `checkpoint.fallback=true` can pick the previous
complete checkpoint instead.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
from typing import Any

import torch

from model.config import K3Config
from model.hf import CheckpointError  # one class for "this checkpoint cannot be used": one line naming the fix
from model.params import build_meta


def _allowed_globals() -> list[Any]:
    out: list[Any] = []
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        out += [LossScaler, DynamicLossScaler]
    except ImportError:
        pass
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        out.append(ZeroStageEnum)
    except ImportError:
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address

        out.append(fragment_address)
    except ImportError:
        pass
    return out


def safe_torch_load(path: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """torch.load that never executes pickled code; any failure becomes a one-line CheckpointError."""
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), "")
        if first:  # a callable/class outside the allowlist: exactly what an exploit pickle needs
            raise CheckpointError(
                f"checkpoint file {path} holds pickled code or an unknown class, refused "
                f"(weights-only loading: {first[:160]}); only load checkpoints you wrote"
            ) from None
        raise CheckpointError(
            f"checkpoint file {path} is corrupted or truncated ({_short(e)}); "
            "delete it or resume from another checkpoint (checkpoint.fallback=true)"
        ) from None
    except Exception as e:  # noqa: BLE001 - damaged bytes make the weights-only unpickler fail in arbitrary ways
        raise CheckpointError(
            f"checkpoint file {path} is corrupted or truncated ({_short(e)}); "
            "delete it or resume from another checkpoint (checkpoint.fallback=true)"
        ) from None


def _short(e: BaseException) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {line[:120]}"


def _check_trainer_state(path: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            ts = json.load(f)
        if not isinstance(ts, dict) or "step" not in ts:
            raise ValueError("no 'step' key")
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint file {path} is missing or corrupted ({_short(e)}); "
            "resume from another checkpoint (checkpoint.fallback=true)"
        ) from None


def verify_checkpoint(tag_dir: str, trainer_state: bool = True) -> None:
    """Raise CheckpointError (one line, naming the file) unless `tag_dir` is loadable without executing code."""
    if trainer_state:
        _check_trainer_state(os.path.join(tag_dir, "trainer_state.json"))
    files = sorted(glob.glob(os.path.join(tag_dir, "*.pt")))
    if not glob.glob(os.path.join(tag_dir, "*model_states.pt")):
        raise CheckpointError(
            f"checkpoint {tag_dir} has no model states file (mp_rank_*_model_states.pt); "
            "resume from another checkpoint (checkpoint.fallback=true)"
        )
    for p in files:
        obj = safe_torch_load(p)
        if p.endswith("mp_rank_00_model_states.pt") and isinstance(obj, dict) and isinstance(obj.get("module"), dict):
            _check_config_matches(tag_dir, obj["module"])


def _check_config_matches(tag_dir: str, module: dict[str, Any]) -> None:
    """The checkpoint's config.json must describe its weights (else export/resume would fail with 60 lines of
    size mismatches): compare every weight's shape with the model config.json builds (on the meta device)."""
    path = os.path.join(tag_dir, "config.json")
    if not os.path.isfile(path):
        return
    try:
        want = {k: tuple(v.shape) for k, v in build_meta(K3Config.from_hf_config(path)).state_dict().items()}
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint file {path} is corrupted ({_short(e)}); resume from another checkpoint "
            "(checkpoint.fallback=true)"
        ) from None
    bad = [
        k
        for k, v in module.items()
        if k in want and isinstance(v, torch.Tensor) and v.numel() and tuple(v.shape) != want[k]
    ]
    if bad:
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(
            f"checkpoint {tag_dir} is inconsistent: {bad[0]} has shape {list(module[bad[0]].shape)} "
            f"but its config.json gives {list(want[bad[0]])}{more}; the checkpoint is damaged or "
            "mixed: resume from another checkpoint (checkpoint.fallback=true)"
        )


def install(engine) -> None:
    """Route every DeepSpeed checkpoint read of this engine through `safe_torch_load`."""
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is None:
        return

    def load(path: str, map_location: Any = None) -> Any:
        return safe_torch_load(path, map_location=map_location if map_location is not None else "cpu")

    ce.load = load  # type: ignore[method-assign]
