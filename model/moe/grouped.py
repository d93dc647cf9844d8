"""The `grouped_mm` expert backend: every local expert's three GEMMs as one `torch.nn.functional.grouped_mm` call
each, with the group offsets on the device (no host sync; docs/performance.md, "Expert backends").

    offs_E = cumsum(counts_E) as int32 (inclusive, no leading 0): expert e owns rows [offs[e-1], offs[e])
    h1 = grouped_mm(z, W1^T), h3 = grouped_mm(z, W3^T)       a = SiTU(h1) * cap(h3) in fp32, cast back
    y  = grouped_mm(a, W2^T)

offs[-1] always equals the row count: grouped_mm leaves output rows past offs[-1] uninitialised, in the gradient
too (pytorch #154557, #193633). Autograd is grouped_mm's own (an expert without rows gets a zero weight gradient).
The values equal the loop backend's (model/moe/experts.py: the same GEMMs per expert, the same fp32 GLU).

grouped_mm takes fp32/bf16/fp16 with 16-byte aligned strides (inner dims multiple of 4 in fp32, 8 in bf16). Other
inputs (fp64, used by the exactness tests; odd widths) go through `_looped`: the same maths one expert at a time
over host offsets, i.e. one device->host read of the counts: documented, and never the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.ffn import cap, situ

BACKENDS = ("auto", "grouped_mm", "loop")


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto` -> grouped_mm on CUDA (one kernel, no host sync), loop on CPU (measured faster there: bench/moe.py,
    docs/performance.md); explicit names pass through."""
    if name not in BACKENDS:
        raise ValueError(f"model.expert_backend must be one of {'|'.join(BACKENDS)}, got {name!r}")
    if name != "auto":
        return name
    return "grouped_mm" if device.type == "cuda" else "loop"


def grouped_mm_ok(x: torch.Tensor, *widths: int) -> bool:
    """Whether grouped_mm's kernels take these operands (dtype, 16-byte aligned inner dims)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    per16 = 16 // x.element_size()
    return all(w % per16 == 0 for w in widths)


def _looped(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """grouped_mm's maths one group at a time (fp64 and unaligned widths; reads the offsets on the host)."""
    bounds = [0, *offs_E.tolist()]
    parts = [x_MK[a:b] @ w_EKN[e] for e, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return torch.cat(parts) if parts else x_MK.new_empty(0, w_EKN.shape[-1])


def _gmm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, fast: bool) -> torch.Tensor:
    return F.grouped_mm(x_MK, w_EKN, offs=offs_E) if fast else _looped(x_MK, w_EKN, offs_E)


def group_offsets(counts_E: torch.Tensor) -> torch.Tensor:
    """int32 inclusive cumulative row counts on counts' device: offs[-1] == rows, by construction."""
    return torch.cumsum(counts_E, 0, dtype=torch.int32)


def grouped_mm_experts(
    z_ML: torch.Tensor,
    offs_E: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    beta1: float,
    beta2: float,
) -> torch.Tensor:
    """y_ML for rows grouped contiguously by expert (expert e: rows offs[e-1]..offs[e]); w1, w3 [E, Im, l],
    w2 [E, l, Im] (stored [out, in], passed transposed: the column-major layout grouped_mm's kernels want)."""
    Im, l = w1.shape[1], w1.shape[2]
    fast = grouped_mm_ok(z_ML, Im, l)
    z_ML = z_ML.contiguous()
    h1 = _gmm(z_ML, w1.transpose(1, 2), offs_E, fast)  # [M, Im]
    h3 = _gmm(z_ML, w3.transpose(1, 2), offs_E, fast)
    a = (situ(h1, beta1) * cap(h3, beta2)).to(z_ML.dtype)  # the GLU in >= fp32, as the loop backend
    return _gmm(a, w2.transpose(1, 2), offs_E, fast)  # [M, l]
