"""LoRA adapters for K3 (pure PyTorch): low-rank updates W + (alpha/r) B A beside frozen base weights.

Why here: the adapters are part of the network's maths, so they live with it; which parameters train, how they
are sharded and checkpointed is training/'s business (training/lora.py).

* `lora_linear` is the functional op: y = x W^T + s * (drop(x) A^T) B^T, with A [r, in], B [out, r], s = alpha/r.
  B starts at zero, so y is the base output bit for bit (the update adds exact zeros).
* `LoRALinear` is an `nn.Linear` whose class is swapped in place (`apply_lora`): its `weight` Parameter (and so
  its name, tags and checkpoint key) is untouched; the factors are children `lora_A.weight` / `lora_B.weight`,
  PEFT's spelling, so adapter keys are the module path + `.lora_A.weight`.
* `ExpertLoRA` holds the routed experts' factors as stacked tensors beside the stacked experts
  (`w1_A [E_local, r, l]`, `w1_B [E_local, Im, r]`, ... for w1, w3, w2), so expert parallelism slices them with
  the experts and the merge is three bmm's, never a Python loop over experts. The experts' dispatchers read
  `LatentExperts.weights()` = base + s * B @ A per expert; the hand-written expert backward yields the gradient of
  that merged weight, and autograd carries it into the factors (dA = s B^T dW, dB = s dW A^T).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from model.moe.mxfp4_experts import MXFP4Experts, to_mxfp4_

# Linear leaf names LoRA may target (KDA + MLA projections, dense FFN / shared experts), plus "experts" (routed).
LINEAR_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "g_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "routed_expert_down_proj",
    "routed_expert_up_proj",
)
EXPERTS_TARGET = "experts"
EXPERT_WEIGHTS = ("w1", "w3", "w2")


@dataclass(frozen=True)
class LoRASpec:
    """rank: linear adapters (attention, dense FFN, shared experts); expert_rank: routed experts (0 = none)."""

    rank: int = 16
    expert_rank: int = 2
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = (
        *("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
        *("gate_proj", "up_proj", "down_proj", EXPERTS_TARGET),
    )
    base_experts: str = "bf16"  # bf16 | mxfp4: frozen routed experts as model-dtype Parameters or MXFP4 codes

    def check(self) -> None:
        bad = [t for t in self.targets if t not in LINEAR_TARGETS + (EXPERTS_TARGET,)]
        if bad:
            raise ValueError(f"lora.targets has unknown names {bad}; choose from {list(LINEAR_TARGETS)} + ['experts']")
        if self.rank < 1 or self.expert_rank < 0:
            raise ValueError(f"lora.rank must be >= 1 and lora.expert_rank >= 0, got {self.rank}/{self.expert_rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.base_experts not in ("bf16", "mxfp4"):
            raise ValueError(f"lora.base_experts must be bf16 or mxfp4, got {self.base_experts}")

    def scale(self, rank: int) -> float:
        return float(self.alpha) / rank


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    dropout: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """x [..., in] -> [..., out]: x W^T + scale * drop(x) A^T B^T (A [r, in], B [out, r])."""
    base = F.linear(x, weight)
    h = F.dropout(x, dropout, training) if dropout > 0.0 else x
    return base + F.linear(F.linear(h, a), b) * scale


class LoRAFactor(nn.Module):
    """One factor `weight [rows, cols]`: A is Kaiming-uniform (PEFT's default), B zero (the base output)."""

    is_adapter = True

    def __init__(self, rows: int, cols: int, zero: bool, device=None) -> None:
        super().__init__()
        self.zero = zero
        self.weight = nn.Parameter(torch.empty(rows, cols, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        if self.zero:
            self.weight.zero_()
        else:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # U(+-1/sqrt(cols)), as nn.Linear and PEFT


class LoRALinear(nn.Linear):
    """nn.Linear + a low-rank update (class swapped in by `apply_lora`; see the module docstring)."""

    lora_A: LoRAFactor
    lora_B: LoRAFactor
    lora_scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return lora_linear(
            x, self.weight, self.lora_A.weight, self.lora_B.weight, self.lora_scale, self.lora_dropout, self.training
        )

    def merged_weight(self) -> torch.Tensor:
        """W + s B A [out, in] (read where the projection's weight is used directly: MLA's kv_b_proj)."""
        return self.weight + (self.lora_B.weight @ self.lora_A.weight) * self.lora_scale


def effective_weight(linear: nn.Linear) -> torch.Tensor:
    """The weight a Linear applies: merged with its adapter when it has one."""
    return linear.merged_weight() if isinstance(linear, LoRALinear) else linear.weight


class ExpertLoRA(nn.Module):
    """Stacked factors of the local routed experts; global expert j of this rank is row j - expert_offset."""

    is_adapter = True

    def __init__(
        self, num_local: int, expert_offset: int, inter: int, latent: int, rank: int, scale: float, device=None
    ):
        super().__init__()
        self.num_local, self.expert_offset, self.rank, self.scale = num_local, expert_offset, rank, scale
        shapes = {"w1": (inter, latent), "w3": (inter, latent), "w2": (latent, inter)}  # [out, in] per expert
        for w, (out, inp) in shapes.items():
            setattr(self, f"{w}_A", nn.Parameter(torch.empty(num_local, rank, inp, device=device)))
            setattr(self, f"{w}_B", nn.Parameter(torch.empty(num_local, out, rank, device=device)))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """B zero; A U(+-1/sqrt(in)), expert j drawn from its own generator (one global draw + j), so every EP
        layout holds the same factors (as LatentExperts.reset_parameters)."""
        if self.w1_A.is_meta:
            return
        base = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        gen = torch.Generator(device=cast(torch.Tensor, self.w1_A).device)
        for j in range(self.num_local):
            gen.manual_seed(base + self.expert_offset + j)
            for w in EXPERT_WEIGHTS:
                a = getattr(self, f"{w}_A")
                bound = 1.0 / math.sqrt(a.shape[-1])
                a[j].uniform_(-bound, bound, generator=gen)
        for w in EXPERT_WEIGHTS:
            getattr(self, f"{w}_B").zero_()

    def delta(self, w: str) -> torch.Tensor:
        """s * B @ A for every local expert: [E_local, out, in] (one bmm)."""
        return torch.bmm(getattr(self, f"{w}_B"), getattr(self, f"{w}_A")) * self.scale

    def merge(self, *base: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(w1, w3, w2) + their updates; exact when B == 0."""
        return tuple(b + self.delta(w) for b, w in zip(base, EXPERT_WEIGHTS))

    def slice_(self, offset: int, num_local: int) -> None:
        """Keep experts [offset, offset + num_local) of the local ones (expert parallelism)."""
        with torch.no_grad():
            for p in self.parameters(recurse=False):
                p.data = p.data[offset : offset + num_local].clone()
        self.num_local, self.expert_offset = num_local, self.expert_offset + offset


def _parent(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


def apply_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Add adapters in place (any device, meta included) to the targeted Linears and routed experts; freeze
    every base parameter. Returns the adapted module names."""
    spec.check()
    adapted = []
    for name, mod in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if type(mod) is nn.Linear and leaf in spec.targets:
            dev = mod.weight.device
            mod.__class__ = LoRALinear
            mod.lora_A = LoRAFactor(spec.rank, mod.in_features, zero=False, device=dev)
            mod.lora_B = LoRAFactor(mod.out_features, spec.rank, zero=True, device=dev)
            mod.lora_scale = spec.scale(spec.rank)  # type: ignore[assignment]  # a float on the module
            mod.lora_dropout = float(spec.dropout)  # type: ignore[assignment]
            adapted.append(name)
        elif leaf == EXPERTS_TARGET and hasattr(mod, "w1") and EXPERTS_TARGET in spec.targets and spec.expert_rank:
            inter, latent = mod.w1.shape[1], mod.w1.shape[2]
            mod.lora = ExpertLoRA(
                mod.num_local,
                mod.expert_offset,
                inter,
                latent,
                spec.expert_rank,
                spec.scale(spec.expert_rank),
                device=mod.w1.device,
            )
            adapted.append(name)
        if leaf == EXPERTS_TARGET and hasattr(mod, "w1") and spec.base_experts == "mxfp4":
            to_mxfp4_(mod)  # frozen experts as MXFP4 code buffers (model/moe/mxfp4_experts.py)
    for pname, p in model.named_parameters():
        p.requires_grad_(is_adapter_param(pname))
    model.lora_spec = spec  # type: ignore[assignment]  # the spec rides on the model (training/lora.py)
    return adapted


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (model.named_parameters()) belongs to an adapter."""
    dotted = f".{name}."
    return ".lora_A." in dotted or ".lora_B." in dotted or ".experts.lora." in dotted


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by parameter name."""
    return {n: p for n, p in model.named_parameters() if is_adapter_param(n)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and drop it: the plain model computing the same function."""
    for mod in list(model.modules()):
        if isinstance(mod, MXFP4Experts):
            mod.to_dense_()  # the merged experts are dense (W + s B A is no longer on the MXFP4 grid)
        if isinstance(mod, LoRALinear):
            mod.weight.copy_(mod.merged_weight())
            del mod.lora_A, mod.lora_B
            mod.__class__ = nn.Linear  # type: ignore[assignment]  # back to the plain class
        elif isinstance(lora := getattr(mod, "lora", None), ExpertLoRA):
            base = [cast(torch.Tensor, getattr(mod, w)) for w in EXPERT_WEIGHTS]  # (w1, w3, w2)
            for w, merged in zip(EXPERT_WEIGHTS, lora.merge(*base)):
                getattr(mod, w).copy_(merged)
            del mod.lora
            mod.lora = None  # type: ignore[assignment]
    for p in model.parameters():
        p.requires_grad_(True)
    if hasattr(model, "lora_spec"):
        del model.lora_spec
    return model
