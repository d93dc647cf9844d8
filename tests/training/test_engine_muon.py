"""Muon optimizer (training/optim/muon.py): orthogonalisation maths and a tiny optimisation problem."""

from __future__ import annotations

import torch
from torch import nn

from training.optim.muon import Muon, newton_schulz, orthogonalise


def test_newton_schulz_maps_singular_values_near_one_for_odd_shapes():
    g = torch.randn(3, 7, 13, dtype=torch.float64)
    s = torch.linalg.svdvals(newton_schulz(g, steps=5))
    assert s.min() > 0.6 and s.max() < 1.25


def test_newton_schulz_keeps_singular_vectors_of_svd():
    g = torch.randn(9, 5, dtype=torch.float64)
    U, _, Vh = torch.linalg.svd(g, full_matrices=False)
    o = newton_schulz(g, steps=5)
    # o = U diag(s') Vh with s' > 0: U^T o Vh^T is diagonal and positive
    d = U.T @ o @ Vh.T
    off = d - torch.diag(torch.diagonal(d))
    assert off.abs().max() < 1e-10 and torch.diagonal(d).min() > 0.5


def test_per_head_orthogonalisation_equals_loop_over_heads():
    H, K, D = 3, 4, 10
    g = torch.randn(H * K, D, dtype=torch.float64)
    got = orthogonalise(g, heads=H, steps=5)
    ref = torch.cat([newton_schulz(g[h * K : (h + 1) * K], 5) for h in range(H)])
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    whole = orthogonalise(g, heads=None, steps=5)
    assert (whole - got).abs().max() > 1e-3  # per head is not the whole-matrix map


def test_stacked_experts_orthogonalised_per_expert_with_shape_scale():
    g = torch.randn(4, 12, 6, dtype=torch.float64)
    got = orthogonalise(g, heads=None, steps=5)
    for e in range(4):
        torch.testing.assert_close(got[e], newton_schulz(g[e], 5) * (12 / 6) ** 0.5, rtol=0, atol=1e-12)


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    a, b = nn.Linear(5, 3), nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    opt_a = Muon([{"params": a.parameters(), "use_muon": False}], lr=1e-2, weight_decay=0.1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randn(8, 5)
    for _ in range(3):
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_muon_fits_a_tiny_linear_regression():
    torch.manual_seed(0)
    W_true = torch.randn(6, 8)
    x = torch.randn(256, 8)
    y = x @ W_true.T
    lin = nn.Linear(8, 6, bias=False)
    opt = Muon([{"params": [lin.weight], "use_muon": True, "heads": 2}], lr=0.05, momentum=0.9)
    first = None
    for _ in range(200):
        opt.zero_grad()
        loss = (lin(x) - y).square().mean()
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.02 * first
