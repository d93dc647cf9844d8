"""TiledMLP-style recompute over sequence tiles for the dense FFN and the shared experts (model/ffn.py, issue 24)."""

from __future__ import annotations

import pytest
import torch

from model.ffn import SiTUGLU
from tests.model.micro import micro_config
from tests.model.test_k3 import random_model


def _glu(seed: int = 0) -> SiTUGLU:
    torch.manual_seed(seed)
    m = SiTUGLU(12, 40, micro_config()).double().train()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(8.0)  # pre-activations of order 1: SiTU and cap far from their linear regime
    return m


@pytest.mark.parametrize("tile", [1, 5, 37, 64])
def test_tiled_ffn_output_and_gradients_match_the_untiled_in_float64(tile):
    """37 tokens (odd; tiles of 5 leave a ragged last one), batch 1 x 37 x 12."""
    x = torch.randn(1, 37, 12, dtype=torch.float64, requires_grad=True)
    g = torch.randn(1, 37, 12, dtype=torch.float64)
    out = []
    for rows in (0, tile):
        m = _glu()
        m.tile_rows = rows
        y = m(x)
        grads = torch.autograd.grad(y, (x, *m.parameters()), g)
        out.append((y.detach(), grads))
    (y0, g0), (y1, g1) = out
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-14)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _saved_numel(m: SiTUGLU, x: torch.Tensor) -> int:
    """Elements autograd keeps for backward from one forward (outside the tiles' own recompute)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x)
    return total


def test_tiled_ffn_keeps_no_t_by_inter_activation_for_backward():
    x = torch.randn(1, 64, 12, dtype=torch.float64, requires_grad=True)
    m = _glu()
    untiled = _saved_numel(m, x)
    m.tile_rows = 8
    tiled = _saved_numel(m, x)
    assert untiled >= 3 * 64 * 40  # gate, up and GLU activations [T, inter] at least
    assert tiled < 64 * 40, tiled


def test_the_model_with_ffn_tiling_gives_identical_loss_and_gradients():
    """fp64 micro model (dense FFN layer, MoE layers with a shared expert), packed documents, tiles of 7 tokens;
    with and without layer activation checkpointing around the tiles."""
    ids = torch.randint(0, 61, (1, 26))
    cu = torch.tensor([0, 5, 14, 26])
    results = []
    for tile, ckpt in ((0, False), (7, False), (7, True)):
        m = random_model(seed=5).train()
        m.set_ffn_tiling(tile)
        m.set_gradient_checkpointing(ckpt)
        out = m(ids, labels=ids, cu_seqlens=cu)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    l0, g0 = results[0]
    assert any(".mlp." in n for n in g0) and any("shared_experts" in n for n in g0)
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, l0, rtol=1e-14, atol=0)
        assert grads.keys() == g0.keys()
        for name in g0:
            torch.testing.assert_close(grads[name], g0[name], rtol=0, atol=1e-12, msg=name)


def test_eval_forward_runs_untiled():
    m = _glu().eval()
    m.tile_rows = 4
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(m(x), m._glu(x))
