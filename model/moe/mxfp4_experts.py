"""Frozen routed experts held as MXFP4 codes (`lora.base_experts=mxfp4`, docs/lora.md).

`to_mxfp4_(experts)` turns a LatentExperts (meta or materialised) into an `MXFP4Experts` in place: the stacked
weights `w1/w3/w2` stop being Parameters and become uint8 buffers `w1_packed [E_local, Im, l/2]` (two E2M1 codes a
byte) and `w1_scale [E_local, Im, l/32]` (one E8M0 exponent per 32 values), model/mxfp4.py's layout, 4.25 bits a
weight. Buffers get no gradient, no optimizer state and no fp32 master copy, and ZeRO-3 does not partition them
(DeepSpeed partitions module parameters only): each rank keeps its (EP-local) experts' codes whole. They are
non-persistent: a checkpoint never holds them (a resume re-reads the base from `model.init_from`).

At use, `weights()` dequantises the local experts of this layer into the compute dtype (`dtype_ref`, a 0-element
float buffer that follows the model's casts) and adds the LoRA update; the dequantised weights are transient:
inside `recompute_merged()` the expert node saves a recipe instead of them and backward dequantises again
(bitwise the same numbers: dequantisation is exact), like the activations it recomputes.
"""

from __future__ import annotations

import torch

from model.moe.experts import LatentExperts
from model.mxfp4 import GROUP, dequantize_stacked, pack_stacked

EXPERT_WEIGHTS = ("w1", "w3", "w2")


class MXFP4Experts(LatentExperts):
    """LatentExperts whose frozen weights are MXFP4 codes (class swapped in by `to_mxfp4_`)."""

    dtype_ref: torch.Tensor

    def reset_parameters(self) -> None:  # the codes come from a checkpoint (or to_mxfp4_), never from an init
        return

    def shape_of(self, w: str) -> tuple[int, int, int]:
        """The logical [E_local, out, in] of weight `w`."""
        packed = getattr(self, f"{w}_packed")
        return packed.shape[0], packed.shape[1], 2 * packed.shape[2]

    def base_weight(self, w: str) -> torch.Tensor:
        """Weight `w` of every local expert, dequantised into the compute dtype: [E_local, out, in]."""
        return dequantize_stacked(getattr(self, f"{w}_packed"), getattr(self, f"{w}_scale"), self.dtype_ref.dtype)

    def _remake(self, w: str) -> torch.Tensor:
        base = self.base_weight(w)
        return base if self.lora is None else base + self.lora.delta(w)  # type: ignore[operator]

    def _recomputes(self) -> bool:
        return True

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        base = (self.base_weight("w1"), self.base_weight("w3"), self.base_weight("w2"))
        merged = base if self.lora is None else self.lora.merge(*base)  # type: ignore[operator]
        self._remember(merged)
        return merged

    @torch.no_grad()
    def to_dense_(self) -> LatentExperts:
        """Back to a plain LatentExperts with the dequantised weights as Parameters (merge/export)."""
        for w in EXPERT_WEIGHTS:
            weight = self.base_weight(w)
            del self._buffers[f"{w}_packed"], self._buffers[f"{w}_scale"]
            self.register_parameter(w, torch.nn.Parameter(weight, requires_grad=False))
        del self._buffers["dtype_ref"]
        self.__class__ = LatentExperts  # type: ignore[assignment]
        return self

    def extra_repr(self) -> str:
        return (
            f"num_local={self.num_local}, expert_offset={self.expert_offset}, mxfp4 "
            f"w1={self.shape_of('w1')}, w2={self.shape_of('w2')}"
        )


@torch.no_grad()
def to_mxfp4_(experts: LatentExperts) -> MXFP4Experts:
    """Replace the stacked expert Parameters by MXFP4 code buffers (round to nearest, model/mxfp4.py pack_mxfp4)
    in place; on the meta device the buffers are meta too (a checkpoint fills them, model/hf.py HFReader)."""
    if isinstance(experts, MXFP4Experts):
        return experts
    dtype, device = experts.w1.dtype, experts.w1.device
    for w in EXPERT_WEIGHTS:
        p = experts._parameters.pop(w)
        assert p is not None
        E, out, inp = p.shape
        if inp % GROUP:
            raise ValueError(f"lora.base_experts=mxfp4 needs expert input widths divisible by {GROUP}; {w} has {inp}")
        if p.is_meta:
            packed = torch.empty(E, out, inp // 2, dtype=torch.uint8, device=device)
            scale = torch.empty(E, out, inp // GROUP, dtype=torch.uint8, device=device)
        else:
            packed, scale = pack_stacked(p.detach())
        experts.register_buffer(f"{w}_packed", packed.to(device), persistent=False)
        experts.register_buffer(f"{w}_scale", scale.to(device), persistent=False)
    experts.register_buffer("dtype_ref", torch.empty(0, dtype=dtype, device=device), persistent=False)
    experts.__class__ = MXFP4Experts
    return experts  # type: ignore[return-value]
