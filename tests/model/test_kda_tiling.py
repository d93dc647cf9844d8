"""The sequence-tiled KDA core for training (model/kda/tiled.py, train.mixer_tile_tokens, issue 24)."""

from __future__ import annotations

import pytest
import torch

from model.kda.tiled import tile_segments
from tests.model.test_kda_layer import make_layer, rand_x


def _run(tile: int, x: torch.Tensor, cu: torch.Tensor | None, dtype=torch.float64):
    layer = make_layer(dtype).train()
    layer.tile_tokens = tile
    x = x.to(dtype).requires_grad_()
    y = layer(x, cu_seqlens=cu)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad((y * w).sum(), (x, *layer.parameters()))
    return y.detach(), grads


def _assert_same(tile: int, x: torch.Tensor, cu: torch.Tensor | None, dtype, tol: float) -> None:
    (y0, g0), (y1, g1) = _run(0, x, cu, dtype), _run(tile, x, cu, dtype)
    torch.testing.assert_close(y1, y0, rtol=0, atol=tol)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_tiled_mixer_equals_untiled_in_float64_on_an_odd_length():
    """B = 2, 83 tokens, tiles of 32 (two chunks of 16; the last tile ragged)."""
    _assert_same(32, rand_x(2, 83), None, torch.float64, 1e-10)


def test_tiled_mixer_equals_untiled_in_float64_on_packed_documents_crossing_tile_edges():
    """Documents 0-20, 20-64 (ends on an edge), 64-71, 71-101 (crosses 96): pieces cut and carried at tile edges."""
    cu = torch.tensor([0, 20, 64, 71, 101])
    _assert_same(32, rand_x(1, 101), cu, torch.float64, 1e-10)


def test_tiled_mixer_equals_untiled_in_float32():
    _assert_same(16, rand_x(1, 75), torch.tensor([0, 40, 75]), torch.float32, 1e-5)


def test_tile_segments_cut_documents_at_the_tile_edges():
    assert tile_segments([0, 20, 64, 71, 101], 64, 96) == ([0, 7, 32], False)
    assert tile_segments([0, 20, 64, 71, 101], 32, 64) == ([0, 32], True)


def test_mixer_tiling_keeps_less_for_backward():
    """Saved tensors of one training forward (the tile checkpoints keep inputs and boundary states only)."""

    def saved(tile: int) -> int:
        layer = make_layer(torch.float32).train()
        layer.tile_tokens = tile
        n = 0

        def pack(t):
            nonlocal n
            n += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(rand_x(1, 256, dtype=torch.float32).requires_grad_())
        return n

    assert saved(32) < 0.6 * saved(0)  # 0.47 measured: inputs + boundary states, no conv or chunk tensors


def test_set_mixer_tiling_refuses_a_tile_off_the_chunk_grid():
    from tests.model.test_k3 import random_model

    with pytest.raises(ValueError, match="multiple of kda_chunk_size"):
        random_model().set_mixer_tiling(7)


def test_mixer_tiling_inside_checkpointed_layers_gives_the_untiled_model_gradients_in_float64():
    """The micro model (chunk 16), activation checkpointing on, packed documents 0-21-50 over tiles of 16."""
    from tests.model.test_k3 import random_model

    ids = torch.randint(0, 61, (1, 50), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 21, 50])
    res = []
    for tile in (0, 16):
        m = random_model().train()
        m.set_gradient_checkpointing(True)
        m.set_mixer_tiling(tile)
        loss = m(ids, labels=ids, cu_seqlens=cu).loss
        loss.backward()
        res.append((loss.detach(), [p.grad for p in m.parameters() if p.grad is not None]))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=0, atol=1e-12)
    assert len(res[1][1]) == len(res[0][1])
    for a, b in zip(res[1][1], res[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
