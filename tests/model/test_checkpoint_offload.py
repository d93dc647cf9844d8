"""Activation checkpoints on the host (model/offload.py, issue 24): same gradients, device inputs not kept."""

from __future__ import annotations

import gc
import weakref

import torch

from tests.model.test_k3 import random_model


def _grads(offload: bool, ckpt: bool = True):
    ids = torch.randint(0, 61, (1, 26), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 5, 14, 26])
    m = random_model(seed=6).train()
    m.set_gradient_checkpointing(ckpt, offload=offload)
    out = m(ids, labels=ids, cu_seqlens=cu)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def test_offloaded_checkpoints_give_the_gradients_of_device_checkpoints_bitwise():
    """fp64 micro model with Block AttnRes (blocks read by several later layers), packed documents."""
    (l0, g0), (l1, g1) = _grads(offload=False), _grads(offload=True)
    assert torch.equal(l0, l1) and g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def _layer_keeps_its_inputs(offload: bool) -> tuple[bool, bool]:
    """(partial, block) still alive after one checkpointed layer's forward, once the caller dropped them."""
    m = random_model(seed=7).train()
    m.set_gradient_checkpointing(True, offload=offload)
    layer = m.model.layers[2]  # inside an AttnRes block: reads the completed block b_0 and the partial sum
    block = torch.randn(1, 9, 32, dtype=torch.float64, requires_grad=True) * 1.0
    partial = torch.randn(1, 9, 32, dtype=torch.float64, requires_grad=True) * 1.0
    refs = weakref.ref(partial), weakref.ref(block)
    _, out, _ = layer([block], partial, None, None, host_copies={})
    del block, partial
    gc.collect()
    alive = tuple(r() is not None for r in refs)
    out.sum().backward()  # the host copies still recompute the layer
    return alive


def test_an_offloaded_checkpoint_does_not_keep_the_device_inputs_alive():
    assert _layer_keeps_its_inputs(offload=False) == (True, True)  # what a device checkpoint holds
    assert _layer_keeps_its_inputs(offload=True) == (False, False)


def test_one_host_copy_per_tensor_per_forward():
    """A completed block read by every later layer is copied to the host once."""
    from model import offload

    calls = []
    real = offload._ToHost.apply

    def counting(x):
        calls.append(x.shape)
        return real(x)

    offload._ToHost.apply = counting
    try:
        _grads(offload=True)
    finally:
        offload._ToHost.apply = real
    # micro model: 5 layers, AttnRes blocks of 2 -> inputs per layer: partial (5) + embedding block b_0 and the
    # block closed at layer 2 (each copied once, not once per reading layer)
    assert len(calls) == 5 + 2, len(calls)
