"""Where metrics go: an append-only JSONL file (always, the offline source of truth) and W&B (offline by default).

Why JSONL first: tests, the offline report and post-mortems read it with no W&B account, no network and no
protobuf; W&B is the dashboard on top. Secrets never reach either: configs are scrubbed of key-like entries.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps

from training.metrics.router import bucket_experts

_SECRET_RE = re.compile(
    r"(api[_-]?key|secret|passw(or)?d|credential|private[_-]?key"
    r"|(^|[_-])(auth|access|hf|bearer|wandb)[_-]?token$|^token$)",
    re.I,
)
REDACTED = "<redacted>"


def scrub_secrets(obj: Any) -> Any:
    """Copy of a nested config with values under secret-looking keys (api_key, secret, password, ...) redacted."""
    if isinstance(obj, Mapping):
        return {
            k: (
                REDACTED
                if isinstance(k, str) and _SECRET_RE.search(k) and not isinstance(v, Mapping)
                else scrub_secrets(v)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [scrub_secrets(v) for v in obj]
    return obj


def to_jsonable(value: Any) -> Any:
    """Python scalars/lists for tensors and numpy values; NaN/inf become None (strict JSON)."""
    if hasattr(value, "detach") and hasattr(value, "numel"):  # torch.Tensor (torch itself is not imported here)
        value = value.detach().cpu().tolist() if value.numel() != 1 else value.item()
    elif isinstance(value, np.generic):
        value = value.item()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


class JsonlSink:
    """One JSON object per line, appended and flushed per record so a killed run loses at most one line."""

    def __init__(self, path: str | os.PathLike, append: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(to_jsonable(record), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All complete records of a JSONL file (a torn last line from a kill is skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def heatmap_rgb(counts_LE: Any, max_columns: int = 128, scale: int = 4) -> np.ndarray:
    """[L, E] loads -> uint8 RGB image (layers down, expert buckets across), colour = load / mean load of the
    layer on a log2 scale clipped to [1/4, 4] (white = balanced, red = hot, blue = cold, black = dead)."""
    c_LB = bucket_experts(counts_LE, max_columns)
    mean_L1 = c_LB.mean(axis=1, keepdims=True)
    ratio = np.divide(c_LB, mean_L1, out=np.zeros_like(c_LB), where=mean_L1 > 0)
    x = (np.clip(np.log2(np.maximum(ratio, 1e-12)), -2.0, 2.0) + 2.0) / 4.0
    rgb = (colormaps["coolwarm"](x)[..., :3] * 255).astype(np.uint8)
    rgb[c_LB == 0] = 0
    return np.repeat(np.repeat(rgb, scale, axis=0), scale, axis=1)


class WandbSink:
    """A W&B run in `mode` offline|online; files under run_dir/wandb; resumable by id.

    Every row is logged at W&B step = the optimizer step (and `step` is also an ordinary metric used as the
    x-axis), so a resumed run continues the same run id and the same step counter, offline too; W&B keeps the
    first value of a step that a resumed run logs again after its last checkpoint.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: Mapping[str, Any],
        mode: str,
        project: str,
        run_id: str | None,
        resume: bool,
        group: str | None = None,
    ) -> None:
        import wandb  # ~1 s to import: only runs that log to W&B pay it

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # everything W&B writes stays in this run's directory (no ~/.cache, ~/.config side files)
        os.environ["WANDB_DIR"] = str(run_dir)
        os.environ["WANDB_CACHE_DIR"] = str(run_dir / "wandb" / ".cache")
        os.environ["WANDB_CONFIG_DIR"] = str(run_dir / "wandb" / ".config")
        os.environ.setdefault("WANDB_SILENT", "true")
        if mode == "offline":
            os.environ["WANDB_MODE"] = "offline"
        self._wandb = wandb
        self.run = wandb.init(
            project=project,
            dir=str(run_dir),
            mode=mode,
            config=to_jsonable(scrub_secrets(dict(config))),
            id=run_id,
            group=group or None,  # the runs of one sweep, shown together (W&B's `group`)
            resume="allow" if (resume or run_id) else None,
            settings=wandb.Settings(
                console="off", x_disable_stats=True, save_code=False, x_save_requirements=False, disable_git=True
            ),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run_id = self.run.id

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log({**{k: v for k, v in to_jsonable(metrics).items() if v is not None}, "step": step}, step=step)

    def log_heatmap(self, step: int, counts_LE: Any, caption: str) -> None:
        img = self._wandb.Image(heatmap_rgb(counts_LE), caption=caption)
        self.run.log({"router/expert_load_heatmap": img, "step": step}, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        for k, v in to_jsonable(values).items():
            self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()
        # finish() returns before the W&B service has flushed the offline file; teardown waits for it, so the run
        # is complete on disk when the logger closes (a following `wandb sync` or reader sees every row)
        self._wandb.teardown()


def _leveldb_records(data: bytes, offset: int, block: int = 32768):
    """Payloads of a LevelDB-log-format stream (the .wandb container): 7-byte headers crc32|len|type,
    records never straddle a 32 KiB block boundary without FIRST/MIDDLE/LAST fragments."""
    buf = b""
    while offset + 7 <= len(data):
        left = block - offset % block
        if left < 7:  # block trailer padding
            offset += left
            continue
        length = int.from_bytes(data[offset + 4 : offset + 6], "little")
        kind = data[offset + 6]
        payload = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:  # FULL
            yield payload
        elif kind == 2:  # FIRST
            buf = payload
        elif kind == 3:  # MIDDLE
            buf += payload
        elif kind == 4:  # LAST
            yield buf + payload
            buf = b""


def read_wandb_offline_history(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """History rows ({key: value}) of every offline W&B run file under run_dir/wandb, in write order.

    Why: proves what an offline run will upload on `wandb sync`, without network or the W&B server.
    """
    rows: list[dict[str, Any]] = []
    for rec in _offline_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in rec.history.item:
                if item.key:
                    row[item.key] = json.loads(item.value_json)
                    continue
                node = row  # media values are flattened into nested keys: rebuild the dict
                for part in item.nested_key[:-1]:
                    node = node.setdefault(part, {})
                node[item.nested_key[-1]] = json.loads(item.value_json)
            rows.append(row)
    return rows


def read_wandb_offline_summary(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run summary the offline W&B run files under run_dir/wandb hold at their end ({key: value}; a metric
    defined with `summary="min"` reads {"min": best}), as `wandb sync` will upload it."""
    out: dict[str, Any] = {}
    for rec in _offline_records(run_dir):
        if rec.WhichOneof("record_type") != "summary":
            continue
        for item in rec.summary.update:
            path = [item.key] if item.key else list(item.nested_key)
            node = out
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = json.loads(item.value_json)
        for item in rec.summary.remove:
            out.pop(item.key, None)
    return out


def read_wandb_offline_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The run record of the newest offline W&B run file under run_dir/wandb: {id, project, group, name} as the
    W&B server will receive them on `wandb sync` (the group ties a sweep's runs together there)."""
    out: dict[str, Any] = {}
    for rec in _offline_records(run_dir):
        if rec.WhichOneof("record_type") == "run":
            r = rec.run
            out = {"id": r.run_id, "project": r.project, "group": r.run_group or None, "name": r.display_name}
    return out


def _offline_records(run_dir: str | os.PathLike):
    """Every record (wandb_internal_pb2.Record) of the offline W&B run files under run_dir/wandb, in write order."""
    from wandb.proto import wandb_internal_pb2 as pb

    for path in sorted(Path(run_dir).glob("wandb/*run-*/run-*.wandb")):
        data = path.read_bytes()
        if data[:4] != b":W&B":
            raise ValueError(f"{path} is not a W&B transaction log (bad magic); pass the run directory")
        for payload in _leveldb_records(data, 7):
            rec = pb.Record()
            rec.ParseFromString(payload)
            yield rec
