"""MXFP4 (OCP microscaling FP4) as stored for the released K3 routed experts (compressed-tensors
`mxfp4-pack-quantized`, group 32).

`weight_packed` uint8 [out, in/2]: two E2M1 codes per byte, the low nibble is the even column. A code is
`sign(bit 3) | magnitude index(bits 0-2)` into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. `weight_scale` uint8 [out, in/32]:
an E8M0 exponent per group of 32 columns, value 2^(s - 127). Dequantisation is exact in fp32/fp64/bf16 (every
product is a power of two times a 3-bit mantissa), so importing the release loses nothing beyond its own
quantisation. `pack_mxfp4` (round to nearest code, per-group scale) quantises dense experts: the release
export (training/tools/export_layout.py), MXFP4 LoRA bases, tests.
"""

from __future__ import annotations

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E8M0_BIAS = 127


def _value_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """All 16 FP4 codes as values: [16] (codes 8..15 are the negatives of 0..7)."""
    mag = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([mag, -mag])


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, in/2] uint8 codes + [out, in/32] uint8 exponents -> [out, in] tensor of `dtype`."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight_packed/weight_scale must be uint8, got {packed.dtype}/{scale.dtype}")
    rows, half = packed.shape
    cols = 2 * half
    if cols % GROUP or tuple(scale.shape) != (rows, cols // GROUP):
        raise ValueError(
            f"MXFP4 weight_scale shape {tuple(scale.shape)} does not match weight_packed "
            f"{tuple(packed.shape)}: expected [{rows}, {cols // GROUP}] (group {GROUP})"
        )
    table = _value_table(dtype, packed.device)
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(rows, cols)  # low nibble = even column
    values = table[codes]  # [out, in]
    exps = scale.to(torch.int64) - _E8M0_BIAS  # [out, in/32]
    factor = torch.pow(torch.tensor(2.0, dtype=torch.float64, device=packed.device), exps.to(torch.float64))
    return (values.view(rows, cols // GROUP, GROUP) * factor.to(dtype).unsqueeze(-1)).reshape(rows, cols)


def _exponent(amax: torch.Tensor) -> torch.Tensor:
    """Per group, the smallest e with amax / 2^e <= 7 (0 for an all-zero group), exactly, from frexp: with
    amax = m 2^p (m in [0.5, 1)), e = p - 3 when m <= 7/8, else p - 2. Clamped to E8M0's [-127, 127]."""
    m, p = torch.frexp(amax)
    exp = torch.where(m <= 0.875, p - 3, p - 2)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    return exp.clamp(-_E8M0_BIAS, 254 - _E8M0_BIAS).to(torch.int64)


_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of E2M1_VALUES: a tie goes to the lower value


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise [out, in] (in % 32 == 0) to (weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]).

    Per group: the smallest power-of-two scale 2^e with max|w| / 2^e <= 7, then each value to the nearest E2M1
    value (ties to the lower magnitude; (6, 7] saturates to 6), the sign bit from the value's sign (-0.0 -> code 8).
    So a group's largest code is always 4 or 6 (the canonical encoding; OCP MX's floor(log2 amax) - 2 rule gives
    the same), and the error stays within one scale step. Round trip: dequantising a canonical (codes, scale) pair
    and quantising it again gives the same bytes: the group's max is v 2^s with v in {4, 6}, so e = s (v <= 7 <
    2v), every value / 2^s is exactly a grid value, and the sign survives as the sign bit (tests pin it).
    Works in fp32 (fp64 inputs in fp64): the exponent comes from frexp and w / 2^e is exact, so the codes equal
    `quantize_mxfp4_reference`'s.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(
            f"pack_mxfp4 needs a 2-D [out, in] tensor with in divisible by {GROUP}, got {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(dtype).reshape(rows, cols // GROUP, GROUP)
    exp = _exponent(w.abs().amax(-1))  # [out, in/32]
    scaled = torch.ldexp(w, (-exp).to(dtype).unsqueeze(-1))  # exact: a power-of-two scaling
    edges = torch.tensor(_THRESHOLDS, dtype=dtype, device=weight.device)
    idx = torch.bucketize(scaled.abs(), edges, right=False)  # edges[i-1] < x <= edges[i] -> i
    codes = (idx + 8 * torch.signbit(scaled).to(torch.int64)).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, (exp + _E8M0_BIAS).to(torch.uint8)


def dequantize_stacked(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stacked experts: [E, out, in/2] codes + [E, out, in/32] exponents -> [E, out, in] of `dtype`."""
    E, rows = packed.shape[0], packed.shape[1]
    flat = dequantize_mxfp4(packed.reshape(E * rows, -1), scale.reshape(E * rows, -1), dtype)
    return flat.view(E, rows, -1)


def pack_stacked(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] -> ([E, out, in/2], [E, out, in/32]), one expert at a time (pack_mxfp4 works in fp64)."""
    parts = [pack_mxfp4(w) for w in weight]
    return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])


def quantize_mxfp4_reference(weight: torch.Tensor) -> tuple[list[int], list[int]]:
    """The slow, obviously-correct quantiser beside pack_mxfp4 (tests): for each group of 32 values in row-major
    order, the smallest integer e with max|w| / 2^e <= 7 (0 for an all-zero group), then each value's code is the
    E2M1 value nearest to |w| / 2^e (the lower one on a tie), sign bit set when w is negative or -0.0. Returns
    (codes, biased exponents) as flat Python lists."""
    import math

    vals = weight.detach().to(torch.float64).reshape(-1).tolist()
    codes, exps = [], []
    for g in range(0, len(vals), GROUP):
        group = vals[g : g + GROUP]
        amax = max(abs(v) for v in group)
        e = 0
        if amax > 0:
            e = math.floor(math.log2(amax)) - 4  # too small: walk up to the smallest e that fits
            while amax / 2.0**e > 7:
                e += 1
        e = max(-_E8M0_BIAS, min(254 - _E8M0_BIAS, e))
        exps.append(e + _E8M0_BIAS)
        for v in group:
            x = abs(v) / 2.0**e
            best = min(range(8), key=lambda i: (abs(x - E2M1_VALUES[i]), i))
            codes.append(best + 8 if math.copysign(1.0, v) < 0 else best)
    return codes, exps
