"""Tiled logits + cross-entropy (model/loss.py, issue 24): the loss of the untiled [T, V] logits, without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model.loss import LMHead, TiledLinearCrossEntropy
from tests.model.test_k3 import random_model


def _inputs(n: int = 37, d: int = 16, v: int = 29, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, dtype=torch.float64, generator=g).requires_grad_()
    w = (torch.randn(v, d, dtype=torch.float64, generator=g) * 0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[[0, 5, n - 1]] = -100
    return h, w, t


@pytest.mark.parametrize("rows", [1, 5, 36, 37, 100])
def test_tiled_loss_and_gradients_match_the_full_logits_reference_in_float64(rows):
    """37 rows (odd, tiles of 5 leave a ragged last tile), some targets ignored, an incoming gradient != 1."""
    h, w, t = _inputs()
    ours = TiledLinearCrossEntropy.apply(h, w, t, rows)
    g_ours = torch.autograd.grad(ours * 1.7, (h, w))
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-100, reduction="sum")
    g_ref = torch.autograd.grad(ref * 1.7, (h, w))
    torch.testing.assert_close(ours, ref, rtol=1e-13, atol=0)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_fp32_tiled_loss_and_gradients_equal_the_untiled_within_1e_6_relative():
    h, w, t = _inputs(n=301, d=24, v=97, seed=1)
    h, w = (x.detach().float().requires_grad_() for x in (h, w))
    ours = TiledLinearCrossEntropy.apply(h, w, t, 16)
    g_ours = torch.autograd.grad(ours, (h, w))
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-100, reduction="sum")
    g_ref = torch.autograd.grad(ref, (h, w))
    assert abs(float(ours.detach()) - float(ref.detach())) <= 1e-6 * abs(float(ref.detach()))
    for a, b in zip(g_ours, g_ref):
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())


class _LargestTensor(TorchDispatchMode):
    """The most elements any op produced while active."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.most = max(self.most, o.numel())
        return out


def test_no_op_of_the_tiled_loss_makes_a_tensor_of_t_times_v_elements():
    n, d, v, rows = 64, 8, 50, 8
    h, w, t = _inputs(n, d, v)
    with _LargestTensor() as seen:
        TiledLinearCrossEntropy.apply(h, w, t, rows).backward()
    assert seen.most <= max(rows * v, n * d, v * d), seen.most
    with _LargestTensor() as full:
        F.cross_entropy(h @ w.t(), t, reduction="sum").backward()
    assert full.most >= n * v  # the probe sees the [T, V] logits where they exist


def test_the_model_with_loss_tiling_gives_the_untiled_loss_and_gradients_on_packed_documents():
    """fp64 model, 2 x 13 tokens packed (documents 5, 9, 12), tiles of 7 tokens: loss and every gradient."""
    ids = torch.randint(0, 61, (1, 26))
    cu = torch.tensor([0, 5, 14, 26])
    results = []
    for tile in (0, 7):
        m = random_model(seed=4).train()
        m.set_loss_tiling(tile)
        out = m(ids, labels=ids, cu_seqlens=cu)
        out.loss.backward()
        assert (out.logits is None) == (tile > 0)
        results.append((out.loss.detach(), int(out.num_loss_tokens), {n: p.grad for n, p in m.named_parameters()}))
    (l0, c0, g0), (l1, c1, g1) = results
    assert c0 == c1 == 26 - 3
    torch.testing.assert_close(l1, l0, rtol=1e-13, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-12, msg=name)


def test_the_head_still_gives_logits_without_targets_and_refuses_targets_untiled():
    head = LMHead(4, 6, bias=False)
    assert head(torch.randn(3, 4)).shape == (3, 6)
    with pytest.raises(ValueError, match="set_loss_tiling"):
        head(torch.randn(3, 4), torch.zeros(3, dtype=torch.long))
