"""Checkpoint readers for the streaming export: one tensor at a time from the checkpoint's own files (issue 37 §1).

Every file is opened with `torch.load(mmap=True, weights_only=True)` (training/checkpoint/safe_load.py): the
pickle is read, the tensor bytes stay on disk until a tensor is asked for, and `release()` drops the maps so the
pages a shard touched leave the process. Model-state names are the module's (`language_model.` for a multimodal
run); stacked experts (`...experts.w1` [E, out, in]) are read one expert at a time through `expert(name, j)`.

* ZeRO-0: the module state file (`mp_rank_00_model_states.pt`).
* Expert files (DeepSpeed-MoE, any EP size): the module file + `layer_*_expert_*` files keyed by global expert id
  (training/parallel/ds_moe.py); expert j of a stacked weight is read from its own file.
* ZeRO-1/2: the fp32 master weights are each rank's flat partition of each parameter group; a parameter is the
  concatenation of the ranks' partitions, narrowed at its offset (DeepSpeed's zero_to_fp32
  `_zero2_merge_trainable_params` contract, with `param_alignment_paddings`), read here piece by piece from the
  mapped partitions instead of concatenating whole groups. Buffers and frozen parameters come from the module
  file (frozen_param_fragments where ZeRO-2 keeps them), as zero_to_fp32 does.
* ZeRO-3 (and AutoEP's zero3_partitioned): DeepSpeed's universal conversion (training/parallel/universal.py)
  into a work directory, then each parameter's `zero/<name>/fp32.pt` on its own; buffers from the model states,
  frozen parameters from the ranks' fragments.
* A HF directory (an export, the release, a LoRA base): `model.hf.HFReader`, experts per expert.
* A module in memory (`export_model`): its state dict.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from model.hf import VISION_PREFIXES, HFReader
from training.checkpoint.safe_load import safe_torch_load

_DS_EXPERT = re.compile(r"^(.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w[123])$")


class Source:
    """Lazy model-state tensors of one checkpoint."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def expert(self, name: str, j: int, shape: tuple[int, ...]) -> torch.Tensor:
        """Expert j ([out, in]) of the stacked expert weight `name` (full shape `shape`)."""
        return self.tensor(name, shape)[j]

    def release(self) -> None:
        """Drop every mapping opened so far (called after each shard)."""


class ModuleSource(Source):
    def __init__(self, model: torch.nn.Module) -> None:
        self.state = model.state_dict()

    def names(self) -> set[str]:
        return set(self.state)

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.state[name].detach()


class Zero0Source(Source):
    def __init__(self, tag_dir: str) -> None:
        self.file = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
        if not os.path.isfile(self.file):
            files = sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))
            if not files:
                raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states; is it a checkpoint step dir?")
            self.file = files[0]
        self._states: dict[str, Any] | None = None
        self._names = set(self.states()["module"])

    def states(self) -> dict[str, Any]:
        if self._states is None:
            self._states = safe_torch_load(self.file, mmap=True)
        return self._states

    def names(self) -> set[str]:
        return set(self._names)

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.states()["module"][name]

    def release(self) -> None:
        self._states = None


class ExpertFilesSource(Zero0Source):
    def __init__(self, tag_dir: str) -> None:
        super().__init__(tag_dir)
        self.where: dict[tuple[str, int], tuple[str, str]] = {}  # (stacked name, global id) -> (file, key)
        for f in sorted(glob.glob(os.path.join(tag_dir, "layer_*_expert_*_mp_rank_00_model_states.pt"))):
            for key in safe_torch_load(f, mmap=True):
                m = _DS_EXPERT.match(key)
                if m is None:
                    raise ValueError(f"unexpected key {key!r} in expert file {f}; not a k3-train expert checkpoint")
                self.where[(f"{m.group(1)}.{m.group(3)}", int(m.group(2)))] = (f, key)
        self._stacked = {name for name, _ in self.where}
        for name in self._stacked:
            ids = sorted(j for n, j in self.where if n == name)
            if ids != list(range(len(ids))):
                raise ValueError(
                    f"expert files for {name} cover ids {ids}, not 0..{len(ids) - 1}: checkpoint incomplete"
                )

    def names(self) -> set[str]:
        return self._names | self._stacked

    def expert(self, name: str, j: int, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._stacked:
            return super().expert(name, j, shape)
        file, key = self.where[(name, j)]
        return safe_torch_load(file, mmap=True)[key]

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name in self._stacked:
            return torch.stack([self.expert(name, j, shape) for j in range(shape[0])])
        return super().tensor(name, shape)


class Zero12Source(Zero0Source):
    def __init__(self, tag_dir: str) -> None:
        super().__init__(tag_dir)
        files = glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_00_optim_states.pt"))
        self.optim_files = sorted(files, key=lambda f: int(os.path.basename(f).split("_")[3]))
        states = self.states()
        osd0 = safe_torch_load(self.optim_files[0], mmap=True)["optimizer_state_dict"]
        sizes = [
            [
                t.numel()
                for t in safe_torch_load(f, mmap=True)["optimizer_state_dict"]["single_partition_of_fp32_groups"]
            ]
            for f in self.optim_files
        ]  # [rank][group]
        paddings = osd0.get("param_alignment_paddings")
        self.span: dict[str, tuple[int, int, int]] = {}  # name -> (group, offset in the group's flat, numel)
        for g, shapes in enumerate(states["param_shapes"]):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = torch.Size(shape).numel()
                self.span[name] = (g, offset, n)
                offset += n + (paddings[g][i] if paddings is not None else 0)
        self.starts = [[sum(sizes[r][g] for r in range(k)) for k in range(len(sizes))] for g in range(len(sizes[0]))]
        self.sizes = sizes
        self._optims: list[dict[str, Any]] | None = None
        self._names |= set(self.span)

    def _partitions(self, g: int) -> list[torch.Tensor]:
        if self._optims is None:
            self._optims = [safe_torch_load(f, mmap=True)["optimizer_state_dict"] for f in self.optim_files]
        return [o["single_partition_of_fp32_groups"][g] for o in self._optims]

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.span:  # buffers, frozen parameters: whole in the module file (ZeRO-2: fragments)
            frozen = self.states().get("frozen_param_fragments") or {}
            return frozen[name] if name in frozen else super().tensor(name, shape)
        g, offset, n = self.span[name]
        pieces = []
        for r, part in enumerate(self._partitions(g)):
            lo, hi = self.starts[g][r], self.starts[g][r] + self.sizes[r][g]
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                pieces.append(part.narrow(0, a - lo, b - a))
        flat = pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)
        return flat.view(shape) if flat.numel() == torch.Size(shape).numel() else flat

    def release(self) -> None:
        super().release()
        self._optims = None


class UniversalSource(Zero0Source):
    def __init__(self, tag_dir: str, work_dir: str) -> None:
        from training.parallel.universal import convert, frozen_params, model_states_file

        self.file = model_states_file(tag_dir)
        self._states = None
        tag = os.path.basename(tag_dir.rstrip("/"))
        done = os.path.join(work_dir, "universal", tag, "DONE")  # converted by rank 0 of a launched export already
        root = os.path.join(work_dir, "universal") if os.path.isfile(done) else convert(tag_dir, work_dir, True)[0]
        self.zero = os.path.join(root, tag, "zero")
        params = {n for n in os.listdir(self.zero) if os.path.isfile(os.path.join(self.zero, n, "fp32.pt"))}
        states = self.states()
        self.buffers = set(states.get("buffer_names") or [])
        self.frozen = frozen_params(tag_dir)
        self._names = params | self.buffers | set(self.frozen)

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name in self.frozen:
            return self.frozen[name]
        if name in self.buffers:
            return self.states()["module"][name]
        t = safe_torch_load(os.path.join(self.zero, name, "fp32.pt"), mmap=True)
        t = t["param"] if isinstance(t, dict) else t
        return t.view(shape) if tuple(t.shape) != tuple(shape) and t.numel() == torch.Size(shape).numel() else t


class HFSource(Source):
    """A HF checkpoint directory; names are the model's (`language_model.` accepted for the text part)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.reader = HFReader(path)
        for file in sorted({f for f, _ in self.reader.where.values()}):
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    if key.startswith(VISION_PREFIXES):
                        self.reader.where[key] = (file, key)
        self._names = set()
        for key in self.reader.where:
            m = re.match(r"^(.*\.experts)\.\d+\.(w[123])\.weight(_packed|_scale)?$", key)
            self._names.add(f"{m.group(1)}.{m.group(2)}" if m else key)

    @staticmethod
    def _text(name: str) -> str:
        return name[len("language_model.") :] if name.startswith("language_model.") else name

    def names(self) -> set[str]:
        return self._names | {"language_model." + n for n in self._names if not n.startswith(VISION_PREFIXES)}

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.reader.read(self._text(name), shape)

    def expert(self, name: str, j: int, shape: tuple[int, ...]) -> torch.Tensor:
        prefix, w = self._text(name).rsplit(".", 1)
        return self.reader.expert(prefix, j, w)

    def release(self) -> None:
        self.reader.close()


def verify_files(tag_dir: str) -> None:
    """Every .pt of the checkpoint loads weights-only (mapped: nothing but the pickles is read), one line if not."""
    for p in sorted(glob.glob(os.path.join(tag_dir, "*.pt"))):
        safe_torch_load(p, mmap=True)


def open_source(tag_dir: str, work_dir: str) -> Source:
    """The reader for a DeepSpeed checkpoint step dir (any ZeRO stage, expert files) or a HF directory."""
    from training.checkpoint import has_expert_files
    from training.parallel.universal import is_zero3_checkpoint

    if not glob.glob(os.path.join(tag_dir, "*.pt")) and glob.glob(os.path.join(tag_dir, "*.safetensors")):
        return HFSource(tag_dir)
    verify_files(tag_dir)
    if has_expert_files(tag_dir):
        return ExpertFilesSource(tag_dir)
    if is_zero3_checkpoint(tag_dir):
        return UniversalSource(tag_dir, work_dir)
    if glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*optim_states.pt")):
        return Zero12Source(tag_dir)
    return Zero0Source(tag_dir)
