"""What an export writes: the output tensors (name, shape, dtype, how to make each) and config.json, per layout.

* `hf` (default): today's export: every tensor as the model holds it (fp32), routed experts split per expert
  (`experts.{j}.w1.weight`), `A_log` zero-padded to ceil(H/128)*128, text-only spelling for a text model and the
  release's (`language_model.`, `vision_tower.*`, `mm_projector.*`) for a multimodal one (model/hf.py).
* `release`: the layout the K3 release ships and vLLM/SGLang read (../shared/k3/HF_KEYS.md): routed experts as
  MXFP4 `weight_packed` uint8 [out, in/2] + `weight_scale` uint8 [out, in/32] (model/mxfp4.py `pack_mxfp4`,
  canonical codes: a release checkpoint loaded and exported again gives its codes back byte for byte), the F32
  tensors of HF_KEYS "per-tensor dtypes" in fp32, everything else bf16; config.json as released: `text_config`
  beside `vision_config` and `media_placeholder_token_id` for a multimodal model (a text model keeps the flat
  text config and spelling), plus compressed-tensors' quantisation block; shards of ~15 GB like the release's
  (1,453.74 GiB in 96).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from model import K3Config, build_model
from model.config import a_log_storage_len
from model.hf import FP32_SUFFIXES, CheckpointError
from model.meta import on_meta
from model.mxfp4 import GROUP, pack_mxfp4
from model.vision.multimodal import K3ForConditionalGeneration
from training.tools.export_safetensors import Entry
from training.tools.export_sources import Source

FORMATS = ("hf", "release")
HF_SHARD_BYTES = 5 * 1024**3  # model/hf.py's default
RELEASE_SHARD_BYTES = 16_300_000_000  # the release: 1,453.74 GiB (1,561 GB) in 96 shards
_STACKED = re.compile(r"^(.*\.block_sparse_moe\.experts)\.(w[123])$")
EXPERT_TARGETS = r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"


def meta_model(config: K3Config) -> torch.nn.Module:
    with on_meta():
        return build_model(config)


def quantization_config() -> dict[str, Any]:
    """compressed-tensors' block for MXFP4 routed experts (group 32, E8M0 scales), the rest left unquantised."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": [EXPERT_TARGETS],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": GROUP,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "torch.uint8",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", "re:.*shared_experts.*", "re:vision_tower.*", "re:mm_projector.*"],
    }


def hf_config(config: K3Config, fmt: str) -> dict[str, Any]:
    d = config.to_hf_config()
    if fmt == "release":
        d["quantization_config"] = quantization_config()
        d["torch_dtype"] = "bfloat16"
    return d


class _Quantised:
    """pack_mxfp4 of the expert weight last asked for: its packed and scale entries are written one after the
    other, so each expert is read and quantised once."""

    def __init__(self) -> None:
        self.key: tuple[str, int] | None = None
        self.value: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self, key: tuple[str, int], read: Callable[[], torch.Tensor], part: int) -> torch.Tensor:
        if self.key != key or self.value is None:
            self.key, self.value = key, pack_mxfp4(read())
        return self.value[part]


def _checked(name: str, t: torch.Tensor, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(
            f"checkpoint {where} is inconsistent: {name} has shape {list(t.shape)} but its config.json gives "
            f"{list(shape)}; the checkpoint is damaged or mixed: export another checkpoint"
        )
    return t


def entries(config: K3Config, source: Source, fmt: str = "hf", where: str = "") -> list[Entry]:
    """The output tensors of `config`'s model read from `source`, in the module's order, for layout `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {list(FORMATS)}")
    meta = meta_model(config)
    state = meta.state_dict()
    have = source.names()
    missing = [k for k in state if k not in have]
    unknown = sorted(k for k in have - set(state) if not k.startswith("language_model.") or k[15:] not in state)
    if missing or (unknown and not isinstance(meta, K3ForConditionalGeneration)):
        raise CheckpointError(
            f"checkpoint {where} does not match its config.json: missing {missing[:5]}, unknown {unknown[:5]}; "
            "export the checkpoint with the config it was trained with"
        )
    quantised = _Quantised()
    out: list[Entry] = []
    for name, m in state.items():
        shape = tuple(m.shape)
        if fmt == "hf":
            dtype = m.dtype
        else:
            dtype = torch.float32 if name.endswith(FP32_SUFFIXES) or not m.is_floating_point() else torch.bfloat16
        st = _STACKED.match(name)
        if st:
            per = shape[1:]
            if fmt == "release" and per[1] % GROUP:
                raise ValueError(
                    f"the release layout stores routed experts as MXFP4 (groups of {GROUP} columns), but {name} has "
                    f"{per[1]} columns; export this model with --format hf"
                )

            def expert(j: int, name: str = name, shape: tuple[int, ...] = shape) -> torch.Tensor:
                return _checked(f"{name}[{j}]", source.expert(name, j, shape), shape[1:], where)

            for j in range(shape[0]):
                base = f"{st.group(1)}.{j}.{st.group(2)}"
                if fmt == "hf":
                    out.append(Entry(f"{base}.weight", per, dtype, lambda j=j, e=expert: e(j).to(dtype).contiguous()))
                    continue
                rows, cols = per
                read = lambda j=j, e=expert: e(j).float()  # noqa: E731
                k = (name, j)
                out.append(
                    Entry(
                        f"{base}.weight_packed",
                        (rows, cols // 2),
                        torch.uint8,
                        lambda k=k, r=read: quantised.get(k, r, 0),
                    )
                )
                out.append(
                    Entry(
                        f"{base}.weight_scale",
                        (rows, cols // GROUP),
                        torch.uint8,
                        lambda k=k, r=read: quantised.get(k, r, 1),
                    )
                )
            continue

        def whole(name: str = name, shape: tuple[int, ...] = shape, dtype: torch.dtype = dtype) -> torch.Tensor:
            return _checked(name, source.tensor(name, shape), shape, where).to(dtype).contiguous()

        key = name
        if name.endswith("self_attn.A_log"):
            n = a_log_storage_len(shape[0])

            def padded(
                whole: Callable[[], torch.Tensor] = whole, n: int = n, dtype: torch.dtype = dtype
            ) -> torch.Tensor:
                t = whole()
                out = torch.zeros(n, dtype=dtype)
                out[: t.shape[0]] = t
                return out

            out.append(Entry(key, (n,), dtype, padded))
        else:
            out.append(Entry(key, shape, dtype, whole))
    return out
