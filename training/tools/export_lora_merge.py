"""`--merge` at size (issue 37 §4): the LoRA base streamed from `model.init_from`, each tensor merged as it is read.

A LoRA checkpoint holds the adapters only; the merged model is base + s B A per adapted weight. Instead of building
the base model and `merge_lora` (training/tools/export_lora.py, the reference), `LoRAMergeSource` reads one base
tensor at a time from the base's safetensors (model/hf.py HFReader, mapped) and one adapter slice at a time from
the checkpoint's `adapters.safetensors`, and returns W + (B @ A) * s in fp32 with the ops of model/lora.py
(`merged_weight`; experts: `ExpertLoRA.delta`'s bmm on expert j's factors). With `lora.base_experts=mxfp4` the
trained model saw the base experts quantised (model/moe/mxfp4_experts.py `to_mxfp4_`): they are quantised and
dequantised the same way before the update is added. The memory bound is the streamed export's.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open

from model.mxfp4 import dequantize_mxfp4, pack_mxfp4
from training.lora import ADAPTER_WEIGHTS, spec_of
from training.tools.export_lora import check_base
from training.tools.export_sources import HFSource


class LoRAMergeSource(HFSource):
    def __init__(self, record: dict, tag_dir: str) -> None:
        check_base(record)
        super().__init__(record["base.path"])
        path = os.path.join(tag_dir, ADAPTER_WEIGHTS)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing; this LoRA checkpoint is incomplete, use an earlier one")
        self.adapters = safe_open(path, framework="pt", device="cpu")
        self.keys = set(self.adapters.keys())  # noqa: SIM118 - safe_open is not iterable
        spec = spec_of(record)
        self.scale, self.expert_scale = spec.scale(spec.rank), spec.scale(spec.expert_rank)
        self.mxfp4 = spec.base_experts == "mxfp4"

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        w = super().tensor(name, shape).to(torch.float32)
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and f"{module}.lora_A.weight" in self.keys:
            a = self.adapters.get_tensor(f"{module}.lora_A.weight").float()
            b = self.adapters.get_tensor(f"{module}.lora_B.weight").float()
            w = w + (b @ a) * self.scale
        return w

    def expert(self, name: str, j: int, shape: tuple[int, ...]) -> torch.Tensor:
        w = super().expert(name, j, shape).to(torch.float32)
        if self.mxfp4:
            w = dequantize_mxfp4(*pack_mxfp4(w), torch.float32)
        prefix, weight = name.rsplit(".", 1)
        a_key, b_key = f"{prefix}.lora.{weight}_A", f"{prefix}.lora.{weight}_B"
        if a_key in self.keys:
            a = self.adapters.get_slice(a_key)[j : j + 1].float()  # [1, r, in]
            b = self.adapters.get_slice(b_key)[j : j + 1].float()  # [1, out, r]
            w = w + (torch.bmm(b, a) * self.expert_scale)[0]
        return w
