"""MXFP4 re-quantisation reproduces a canonical encoding byte for byte (the release export's round trip, issue 37).

Canonical: every non-zero group's largest code is 4 or 6 (what pack_mxfp4 and OCP MX's floor(log2 amax) - 2 rule
write). Then dequantise -> pack_mxfp4 returns the same codes and scales, whatever the sign bits and every scale the
dequantised dtype holds (fp32/bf16: 2^-127 .. 2^125, fp64: all 255)."""

from __future__ import annotations

import pytest
import torch

from model.mxfp4 import GROUP, dequantize_mxfp4, pack_mxfp4, quantize_mxfp4_reference


def _canonical(rows: int, groups: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (rows, groups * GROUP), generator=g)
    at = torch.randint(0, GROUP, (rows, groups), generator=g)  # where each group keeps its max
    mag = torch.tensor([6, 7])[torch.randint(0, 2, (rows, groups), generator=g)]  # codes 6, 7 = values 4, 6
    sign = 8 * torch.randint(0, 2, (rows, groups), generator=g)
    view = codes.view(rows, groups, GROUP)
    low = view & 0x7
    view.copy_((view & 0x8) | torch.minimum(low, mag.unsqueeze(-1)))  # nothing above the group's max
    view.scatter_(2, at.unsqueeze(-1), (mag + sign).unsqueeze(-1))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scale = torch.randint(0, 255, (rows, groups), generator=g).to(torch.uint8)  # every E8M0 value but NaN
    return packed, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_dequantised_canonical_codes_requantise_to_the_same_bytes(dtype):
    g = torch.Generator().manual_seed(0)
    top = 255 if dtype == torch.float64 else 253  # 4 * 2^126 is past fp32's and bf16's range
    packed, scale = _canonical(top, 4, g)
    scale = scale % top
    scale[:, 0] = torch.arange(top, dtype=torch.uint8)  # every exponent, the subnormal and huge ends included
    again = pack_mxfp4(dequantize_mxfp4(packed, scale, dtype))
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)


def test_quantiser_output_is_canonical_and_equals_its_reference():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4 * GROUP, generator=g) * torch.logspace(-30, 30, 16).unsqueeze(1)
    w[0, :GROUP] = 0.0  # an all-zero group: scale 2^0
    w[1, :GROUP] = torch.linspace(-3.5, 3.5, GROUP)  # max 3.5: a tie that must not leave a max code of 3
    w[2, :GROUP] = torch.linspace(-7.0, 6.5, GROUP)  # (6, 7] saturates to 6 at the same scale
    w[3, 0] = -0.0
    packed, scale = pack_mxfp4(w)
    codes, exps = quantize_mxfp4_reference(w)
    p = packed.to(torch.int64)
    assert torch.stack([p & 0xF, p >> 4], -1).reshape(-1).tolist() == codes
    assert scale.reshape(-1).tolist() == exps
    mags = torch.tensor(codes).view(16, 4, GROUP) & 0x7
    nonzero = w.view(16, 4, GROUP).abs().amax(-1) > 0
    assert ((mags.amax(-1) >= 6) | ~nonzero).all()  # canonical: the group max is 4 or 6
    assert scale[0, 0] == 127 and (p[3, 0] & 0xF) == 8  # -0.0 keeps its sign bit
    again = pack_mxfp4(dequantize_mxfp4(packed, scale))
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)
