"""Hugging Face checkpoint IO: `config.json` + safetensors in the released key layout (docs/model.md §12).

The module tree already uses the HF names, so the mapping is small:
- prefixes: a text model saves the text-only spelling (`model.*`, `lm_head.weight`), a K3ForConditionalGeneration
  the release's (`language_model.model.*`, `language_model.lm_head.weight`, `vision_tower.*`, `mm_projector.*`,
  whose module tree already has those names); load accepts both text spellings, and builds the multimodal model
  when config.json has a `vision_config`. Dropping vision is explicit (`text_only=True`, logged in one line);
  vision tensors without a `vision_config` are an error;
- routed experts: HF has one tensor per expert (`experts.{j}.w1.weight` [Im, l]); the model stacks them
  (`experts.w1` [E, Im, l]). Released experts are MXFP4 (`weight_packed` + `weight_scale`), dequantised on load;
- `A_log`: stored zero-padded to ceil(H/128)*128 (docs/model.md §12); the model holds [H]; load uses the first H.
Loading reads safetensors only (never pickles) and checks the key set: unknown or missing keys raise one error
listing them unless `strict=False`. With `dtype`, floating tensors are cast except the docs/model.md §12 fp32 ones.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.config import K3Config, a_log_storage_len
from model.k3 import K3ForCausalLM
from model.meta import on_meta
from model.mtp import drop_unused_mtp_tensors
from model.mxfp4 import dequantize_mxfp4, pack_mxfp4
from model.vision.multimodal import K3ForConditionalGeneration

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
IGNORED_PREFIXES = VISION_PREFIXES  # what the text-only readers (HFReader) skip
# Kept in fp32 whatever dtype is requested (released as F32; tiny and numerically sensitive).
FP32_SUFFIXES = (
    "q_conv1d.weight",
    "k_conv1d.weight",
    "v_conv1d.weight",
    "A_log",
    "dt_bias",
    "o_norm.weight",
    "gate.e_score_correction_bias",
)
_EXPERT_RE = re.compile(
    r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\."
    r"(weight|weight_packed|weight_scale)$"
)
_STACKED_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$")
_CODES_RE = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])_(packed|scale)$")  # mxfp4 base


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; the message lists the offending keys."""


def _keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


def target_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """`dtype`, except that the docs/model.md §12 fp32 tensors are never narrowed below fp32 (fp64 widens them too)."""
    if _keeps_fp32(name) and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def _listing(keys: list[str], limit: int = 20) -> str:
    keys = sorted(keys)
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


# --- save ---------------------------------------------------------------------------------------------------------


def build_model(config: K3Config) -> K3ForCausalLM | K3ForConditionalGeneration:
    """The model `config` describes: K3ForConditionalGeneration with a vision_config, else K3ForCausalLM."""
    return K3ForCausalLM(config) if config.vision_config is None else K3ForConditionalGeneration(config)


def _cpu(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t.detach().to("cpu", copy=True).contiguous()


def _text_entries(lm: K3ForCausalLM, prefix: str) -> Iterator[tuple[str, int, Callable[[], torch.Tensor]]]:
    """(HF key, stored bytes, materialise) of the text model: experts split, A_log padded."""
    for name, t in lm.state_dict().items():
        m = _STACKED_RE.match(name)
        if m:
            per = t[0].numel() * t.element_size()
            for j in range(t.shape[0]):
                yield f"{prefix}{m.group(1)}.{j}.{m.group(2)}.weight", per, _cpu(t[j])
        elif name.endswith("self_attn.A_log"):

            def padded(t: torch.Tensor = t) -> torch.Tensor:
                out = torch.zeros(a_log_storage_len(t.shape[0]), dtype=t.dtype)
                out[: t.shape[0]] = t.detach().cpu()
                return out

            yield prefix + name, a_log_storage_len(t.shape[0]) * t.element_size(), padded
        else:
            yield prefix + name, t.numel() * t.element_size(), _cpu(t)


def _entries(model: torch.nn.Module) -> Iterator[tuple[str, int, Callable[[], torch.Tensor]]]:
    if isinstance(model, K3ForConditionalGeneration):  # the release's spelling; vision tensors as they are
        yield from _text_entries(model.language_model, "language_model.")
        for sub in ("vision_tower", "mm_projector"):
            for name, t in getattr(model, sub).state_dict().items():
                yield f"{sub}.{name}", t.numel() * t.element_size(), _cpu(t)
    else:
        yield from _text_entries(model, "")


def hf_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state as (HF key, CPU tensor) pairs: text-only spelling for K3ForCausalLM, the release's
    (`language_model.` + vision) for K3ForConditionalGeneration; experts split, A_log padded."""
    for key, _, make in _entries(model):
        yield key, make()


def save_hf_checkpoint(
    model: torch.nn.Module, path: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Write `config.json` and safetensors into directory `path`: one `model.safetensors`, or shards
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json` when above `max_shard_bytes`.
    A K3ForCausalLM whose config has a tower holds none: its config.json is written text-only (logged).
    Returns the written tensor file names."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    config = model.config
    if not isinstance(model, K3ForConditionalGeneration) and config.vision_config is not None:
        log.warning("save_hf_checkpoint: a K3ForCausalLM holds no vision tower; writing a text-only config.json")
        config = config.text_only()
    config.save(path)
    # plan shards from sizes first (no copies), then materialise one shard at a time
    sizes = [(key, n) for key, n, _ in _entries(model)]
    shard_of: dict[str, int] = {}
    shard, used = 0, 0
    for key, n in sizes:
        if used and used + n > max_shard_bytes:
            shard, used = shard + 1, 0
        shard_of[key] = shard
        used += n
    n_shards = shard + 1
    names = (
        [SINGLE_FILE]
        if n_shards == 1
        else [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    )
    for stale in (SINGLE_FILE, INDEX_FILE):  # do not leave a mix of layouts behind
        if os.path.exists(os.path.join(path, stale)) and stale not in names:
            os.remove(os.path.join(path, stale))
    current, buf = 0, {}
    for key, t in hf_tensors(model):
        if shard_of[key] != current:
            save_file(buf, os.path.join(path, names[current]), metadata={"format": "pt"})
            current, buf = shard_of[key], {}
        buf[key] = t
    save_file(buf, os.path.join(path, names[current]), metadata={"format": "pt"})
    if n_shards > 1:
        index = {
            "metadata": {"total_size": sum(n for _, n in sizes)},
            "weight_map": {k: names[s] for k, s in shard_of.items()},
        }
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return names


# --- load ---------------------------------------------------------------------------------------------------------


def _tensor_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {path}; pass a directory written by "
        "save_hf_checkpoint or a HF K3 checkpoint (safetensors only, no .bin)"
    )


def _canonical(key: str, vision: bool = False) -> str | None:
    """Text-only spelling of a released key; vision keys as they are with `vision`, else None."""
    if key.startswith(VISION_PREFIXES):
        return key if vision else None
    if key.startswith("language_model."):
        key = key[len("language_model.") :]
    return key


def read_hf_state(path: str | os.PathLike, vision: bool = False) -> dict[str, torch.Tensor]:
    """All text tensors of a checkpoint directory, keys in the text-only spelling; with `vision`, the
    `vision_tower.*` / `mm_projector.*` tensors too (under their own names), else those are not read."""
    out: dict[str, torch.Tensor] = {}
    for file in _tensor_files(os.fspath(path)):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safetensors safe_open is not iterable
                name = _canonical(key, vision)
                if name is not None:
                    out[name] = f.get_tensor(key)
    return out


def to_model_state(
    hf_state: dict[str, Any], model_state: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Convert HF tensors to the model's state-dict layout. Returns (state, unknown HF keys, missing model keys).

    `model_state` only provides names/shapes (a meta-device state dict is fine)."""
    state: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
    mx: dict[tuple[str, int, str], dict[str, torch.Tensor]] = defaultdict(dict)
    for key, t in hf_state.items():
        m = _EXPERT_RE.match(key)
        if m:
            prefix, j, w, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            if kind == "weight":
                experts[(prefix, w)][j] = t
            else:
                mx[(prefix, j, w)][kind] = t
            continue
        if key not in model_state:
            unknown.append(key)
            continue
        if key.endswith("self_attn.A_log"):
            H = model_state[key].shape[0]
            if t.dim() != 1 or t.shape[0] < H:
                raise CheckpointError(f"{key} has shape {tuple(t.shape)}; expected [>= {H}] (num_heads, padded)")
            t = t[:H]
        state[key] = t
    for (prefix, j, w), parts in mx.items():
        if set(parts) != {"weight_packed", "weight_scale"}:
            unknown.append(f"{prefix}.{j}.{w}.{next(iter(parts))} (its MXFP4 partner is missing)")
            continue
        ref = model_state.get(f"{prefix.rsplit('.', 1)[0]}.routed_expert_down_proj.weight")
        deq_dtype = dtype or (ref.dtype if ref is not None and ref.dtype.is_floating_point else torch.float32)
        experts[(prefix, w)][j] = dequantize_mxfp4(parts["weight_packed"], parts["weight_scale"], deq_dtype)
    for (prefix, w), per in experts.items():
        name = f"{prefix}.{w}"
        if name not in model_state:
            unknown += [f"{prefix}.{j}.{w}.weight" for j in per]
            continue
        E = model_state[name].shape[0]
        extra = [j for j in per if j >= E]
        unknown += [f"{prefix}.{j}.{w}.weight" for j in extra]
        if any(j not in per for j in range(E)):
            continue  # reported as missing below
        state[name] = torch.stack([per[j].to(per[0].dtype) for j in range(E)])
    missing = [k for k in model_state if k not in state]
    for key, t in state.items():
        want = tuple(model_state[key].shape)
        if tuple(t.shape) != want:
            raise CheckpointError(
                f"{key} has shape {tuple(t.shape)} but the config expects {want}; "
                "is config.json from the same checkpoint?"
            )
        if dtype is not None and t.is_floating_point():
            state[key] = t.to(target_dtype(key, dtype))
    return state, unknown, missing


def _vision_state(
    hf_state: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """The vision tensors (same names in checkpoint and model): (state, unknown keys, missing keys)."""
    want = {k: t for k, t in model_state.items() if k.startswith(VISION_PREFIXES)}
    state, unknown = {}, []
    for key, t in hf_state.items():
        if not key.startswith(VISION_PREFIXES):
            continue
        if key not in want:
            unknown.append(key)
            continue
        if tuple(t.shape) != tuple(want[key].shape):
            raise CheckpointError(
                f"{key} has shape {tuple(t.shape)} but the vision_config expects {tuple(want[key].shape)}; "
                "is config.json from the same checkpoint?"
            )
        state[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return state, unknown, [k for k in want if k not in state]


def load_hf_checkpoint(
    path: str | os.PathLike,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    strict: bool = True,
    config_overrides: dict[str, Any] | None = None,
    text_only: bool = False,
) -> K3ForCausalLM | K3ForConditionalGeneration:
    """Build the model of a HF checkpoint directory (config.json + safetensors, flat or `text_config`):
    K3ForConditionalGeneration when config.json has a `vision_config`, else K3ForCausalLM.

    `dtype=None` keeps the stored dtypes; `config_overrides` replace project-only settings (e.g. kda_chunk_size).
    `text_only=True` (or `config_overrides={"vision_config": None}`) builds the text model of a multimodal
    checkpoint and says so in one logged line. With `strict=False`, unknown keys are ignored and missing ones keep
    their fresh initialisation."""
    path = os.fspath(path)
    config = K3Config.from_hf_config(path)
    had_vision = config.vision_config is not None
    if config_overrides:
        config = config.replace(**config_overrides)
    if text_only or config.vision_config is None:
        config = config.text_only()
    hf_state = read_hf_state(path, vision=True)
    hf_state = drop_unused_mtp_tensors(hf_state, config.num_hidden_layers, config.mtp_depth, path)
    n_vision = sum(k.startswith(VISION_PREFIXES) for k in hf_state)
    if n_vision and config.vision_config is None and (had_vision or text_only):  # explicit: drop them, visibly
        log.warning(
            f"load_hf_checkpoint: text-only model from the multimodal checkpoint {path}: "
            f"dropping its {n_vision} vision tensors (vision_tower.*, mm_projector.*)"
        )
        hf_state = {k: t for k, t in hf_state.items() if not k.startswith(VISION_PREFIXES)}
    with on_meta():
        meta = build_model(config)
    lm_meta = meta.language_model if isinstance(meta, K3ForConditionalGeneration) else meta
    text_hf = {k: t for k, t in hf_state.items() if not k.startswith(VISION_PREFIXES)}
    state, unknown, missing = to_model_state(text_hf, lm_meta.state_dict(), dtype)
    if isinstance(meta, K3ForConditionalGeneration):
        state = {"language_model." + k: t for k, t in state.items()}
        missing = ["language_model." + k for k in missing]
        v_state, v_unknown, v_missing = _vision_state(hf_state, meta.state_dict(), dtype)
        state.update(v_state)
        unknown, missing = unknown + v_unknown, missing + v_missing
    else:
        unknown += [k for k in hf_state if k.startswith(VISION_PREFIXES)]
    if strict and (unknown or missing):
        hint = (
            " (vision tensors but no vision_config in config.json: add it, or drop them with text_only=True)"
            if n_vision and not had_vision
            else ""
        )
        raise CheckpointError(
            f"checkpoint {path} does not match the config: unknown keys [{_listing(unknown)}]; "
            f"missing keys [{_listing(missing)}] (pass strict=False to load anyway){hint}"
        )
    if not missing:
        meta.load_state_dict(state, strict=True, assign=True)
        leftovers = [n for n, t in list(meta.named_parameters()) + list(meta.named_buffers()) if t.is_meta]
        model = meta if not leftovers else None
    else:
        model = None
    if model is None:  # something was not in the checkpoint: start from a real initialisation
        model = build_model(config)
        if dtype is not None:
            _cast_keep_fp32(model, dtype)
        model.load_state_dict(state, strict=False)
    if device is not None:
        model = model.to(device)
    return model


def _cast_keep_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters/buffers to `dtype`; the docs/model.md §12 fp32 tensors stay >= fp32."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point():
            t.data = t.data.to(target_dtype(name, dtype))


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model.to(dtype)` that keeps the docs/model.md §12 fp32 tensors (conv weights, A_log, dt_bias, o_norm,
    router bias)
    in fp32; use it instead of `.to(torch.bfloat16)`."""
    _cast_keep_fp32(model, dtype)
    return model


# --- lazy, sharded reading (one rank reads only what it holds) ---------------------------------------------------


class HFReader:
    """Reads model-state tensors, or row slices of them, straight from a HF checkpoint's safetensors shards.

    Why: a rank of a sharded run owns a slice of each dense tensor and E/P of the experts; reading the whole
    checkpoint into every process (5.5 TB for the 2.78T release) is what this avoids. Keys are located through
    `model.safetensors.index.json` (or the single file) and read with `safe_open(...).get_slice`, so only the
    requested rows leave the file. Names are the model's state-dict names; the released spelling is accepted
    (`language_model.` prefix, `vision_tower.*`/`mm_projector.*` never read), `A_log` is unpadded, and routed
    experts are read per expert (`experts.{j}.w1.weight`, or MXFP4 `weight_packed`/`weight_scale` dequantised
    one expert at a time). `bytes_read` counts the tensor bytes fetched (for the start-up benchmark).
    """

    def __init__(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        self.path, self.dtype = os.fspath(path), dtype
        self.where: dict[str, tuple[str, str]] = {}  # canonical key -> (file, stored key)
        for file in _tensor_files(self.path):
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safetensors safe_open is not iterable
                    name = _canonical(key)
                    if name is not None:
                        self.where[name] = (file, key)
        self._open: dict[str, Any] = {}
        self._quantised: tuple[str, Any] = ("", None)
        self.bytes_read = 0

    def _handle(self, file: str):
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt", device="cpu")
        return self._open[file]

    def _rows(self, key: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        if key not in self.where:
            raise CheckpointError(
                f"checkpoint {self.path} has no tensor {key}; is config.json from the same checkpoint?"
            )
        file, stored = self.where[key]
        sl = self._handle(file).get_slice(stored)
        t = sl[:] if lo is None else sl[lo:hi]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _cast(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(target_dtype(name, self.dtype)) if self.dtype is not None and t.is_floating_point() else t

    def expert(self, prefix: str, j: int, w: str) -> torch.Tensor:
        """Routed expert j's `w` ([out, in]) of the experts module at `prefix`, dequantised if MXFP4."""
        key = f"{prefix}.{j}.{w}"
        if f"{key}.weight" in self.where:
            return self._rows(f"{key}.weight")
        packed, scale = self._rows(f"{key}.weight_packed"), self._rows(f"{key}.weight_scale")
        return dequantize_mxfp4(packed, scale, self.dtype or torch.float32)

    def expert_codes(self, prefix: str, j: int, w: str, part: str) -> torch.Tensor:
        """Expert j's `w` as MXFP4 `weight_packed` or `weight_scale` (part "packed" | "scale"): the release's codes
        as stored, or a dense checkpoint's weight quantised here (round to nearest, model/mxfp4.py pack_mxfp4)."""
        key = f"{prefix}.{j}.{w}"
        if f"{key}.weight_{part}" in self.where:
            return self._rows(f"{key}.weight_{part}")
        if self._quantised[0] != key:  # packed and scale of one expert are read in turn: quantise it once
            self._quantised = (key, pack_mxfp4(self._rows(f"{key}.weight").to(torch.float32)))
        return self._quantised[1][0 if part == "packed" else 1]

    def read(
        self, name: str, shape: tuple[int, ...], lo: int = 0, hi: int | None = None, expert_offset: int = 0
    ) -> torch.Tensor:
        """Rows [lo, hi) (dim 0) of model tensor `name` whose full model shape is `shape`. For stacked experts
        (`...experts.w1` [E_local, ...]) row r is global expert `expert_offset + r`."""
        hi = shape[0] if hi is None else hi
        m, c = _STACKED_RE.match(name), _CODES_RE.match(name)
        if c:
            parts = [self.expert_codes(c.group(1), expert_offset + r, c.group(2), c.group(3)) for r in range(lo, hi)]
            t = torch.stack(parts) if parts else torch.empty((0, *shape[1:]), dtype=torch.uint8)
        elif m:
            parts = [self.expert(m.group(1), expert_offset + r, m.group(2)) for r in range(lo, hi)]
            t = torch.stack(parts) if parts else torch.empty((0, *shape[1:]))
        else:  # (A_log is stored zero-padded to ceil(H/128)*128: rows < H are the model's)
            t = self._rows(name, lo, hi)
        if tuple(t.shape[1:]) != tuple(shape[1:]):
            raise CheckpointError(
                f"{name} has rows of shape {tuple(t.shape[1:])} but the config expects "
                f"{tuple(shape[1:])}; is config.json from the same checkpoint?"
            )
        return self._cast(name, t)

    def close(self) -> None:
        self._open.clear()
