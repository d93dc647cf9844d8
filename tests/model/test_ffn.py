"""SiTU-GLU (docs/model.md §5 (report Eq. 12), §10 item 13)."""

from __future__ import annotations

import math

import torch

from model.config import K3Config
from model.ffn import SiTUGLU, cap, situ, situ_glu, tanh

B1, B2 = 4.0, 25.0


def test_situ_matches_formula_fp64():
    a = torch.randn(1000, dtype=torch.float64) * 10
    ref = torch.tensor([B1 * math.tanh(v / B1) / (1 + math.exp(-v)) for v in a.tolist()], dtype=torch.float64)
    torch.testing.assert_close(situ(a, B1), ref, rtol=1e-12, atol=1e-12)


def test_cap_matches_formula_fp64():
    u = torch.randn(1000, dtype=torch.float64) * 50
    ref = torch.tensor([B2 * math.tanh(v / B2) for v in u.tolist()], dtype=torch.float64)
    torch.testing.assert_close(cap(u, B2), ref, rtol=1e-12, atol=1e-12)


def test_glu_elements_bounded_by_100():
    g = torch.randn(4096, dtype=torch.float64) * 10
    u = torch.randn(4096, dtype=torch.float64) * 30
    assert situ_glu(g, u, B1, B2).abs().max() < B1 * B2
    assert situ(g, B1).abs().max() < B1 and cap(u, B2).abs().max() < B2
    huge = torch.randn(4096, dtype=torch.float64) * 1e6  # tanh rounds to 1 here: the bound holds with equality
    assert situ_glu(huge, huge.flip(0), B1, B2).abs().max() <= B1 * B2


def test_glu_saturates_at_100_for_huge_gate_and_up():
    big = torch.tensor([1e6], dtype=torch.float64)
    assert float(situ_glu(big, big, B1, B2)) == 100.0
    assert abs(float(situ_glu(torch.tensor([60.0]), torch.tensor([300.0]), B1, B2)) - 100.0) < 1e-3


def test_tanh_via_sigmoid_matches_torch_tanh():
    x = torch.randn(10000, dtype=torch.float64) * 30
    torch.testing.assert_close(tanh(x), torch.tanh(x), rtol=0, atol=1e-15)
    x32 = x.float()
    torch.testing.assert_close(tanh(x32), torch.tanh(x32), rtol=0, atol=2e-7)
    assert tanh(torch.tensor([1e4, -1e4])).tolist() == [1.0, -1.0]


def test_situ_is_silu_like_near_zero():
    a = torch.linspace(-0.05, 0.05, 11, dtype=torch.float64)
    torch.testing.assert_close(situ(a, B1), torch.nn.functional.silu(a), rtol=0, atol=1e-5)


def test_activation_computed_in_fp32_for_bf16_inputs():
    a = torch.randn(64, dtype=torch.bfloat16) * 8
    assert situ(a, B1).dtype == torch.float32 and cap(a, B2).dtype == torch.float32
    out = situ_glu(a, a, B1, B2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float(), situ(a.double(), B1).float() * cap(a.double(), B2).float(), rtol=1e-2, atol=1e-2
    )


def test_situglu_module_is_down_of_situ_gate_times_cap_up():
    cfg = K3Config.preset("tiny")
    m = SiTUGLU(32, 48, cfg).double()
    assert m.gate_proj.weight.shape == (48, 32) and m.up_proj.weight.shape == (48, 32)
    assert m.down_proj.weight.shape == (32, 48) and m.gate_proj.bias is None
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    g, u = x @ m.gate_proj.weight.t(), x @ m.up_proj.weight.t()
    ref = (B1 * torch.tanh(g / B1) * torch.sigmoid(g) * B2 * torch.tanh(u / B2)) @ m.down_proj.weight.t()
    torch.testing.assert_close(m(x), ref, rtol=1e-12, atol=1e-12)


def test_situglu_init_std_and_meta_build():
    cfg = K3Config.preset("tiny")
    m = SiTUGLU(256, 1024, cfg)
    assert abs(float(m.gate_proj.weight.detach().std()) - cfg.initializer_range) < 2e-3
    with torch.device("meta"):
        meta = SiTUGLU(7168, 33792, K3Config.preset("k3"))
    assert sum(p.numel() for p in meta.parameters()) == 726_663_168
