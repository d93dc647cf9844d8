"""The chunked KDA kernel never computes on subnormal fp32 values (docs/performance.md, "Denormals"): x86 cores
take a microcode assist per subnormal operand, which made chunk 64 7x slower on an Intel Xeon. Checked here on
every machine by looking at the values, not the time: every aten op's output inside forward + backward."""

from __future__ import annotations

import pytest
import torch

from bench.kda import make_inputs
from bench.probes import find_subnormals
from model.kda.chunk import flush_denormals, flush_denormals_enabled
from model.kda.ops import chunk_kda


@pytest.fixture
def one_thread():
    """The kernel's flush-to-zero covers its own thread; intra-op workers keep theirs (see flush_denormals)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("chunk_size", [64, 32])
def test_chunked_kda_intermediates_carry_no_subnormals(one_thread, chunk_size):
    xs = make_inputs(512)  # the bench's inputs: g at the K3 bound (-5, 0), where chunk 64 spans e^-315
    with find_subnormals() as found:
        o, _ = chunk_kda(*xs, chunk_size=chunk_size)
        o.sum().backward()
    assert found.checked > 100  # the probe saw the kernel's ops
    assert not found.hits, f"subnormal outputs ({found.values}) of {found.checked_values} values"


def test_decay_factors_are_normal_without_flush_to_zero(monkeypatch, one_thread):
    """Whatever the thread's FTZ setting, the elementwise decay products (exp, exp * operand) stay normal: only
    tiny interactions inside batched matmuls are left to flush-to-zero. (Before the factors were flushed, 4% of
    all values the elementwise ops wrote were subnormal; an isolated product of two tiny gradients may remain.)"""
    monkeypatch.setattr("model.kda.chunk.flush_denormals", _no_flush)
    xs = make_inputs(512)
    with find_subnormals() as found:
        o, _ = chunk_kda(*xs, chunk_size=64)
        o.sum().backward()
    elementwise = {op: n for op, n in found.values.items() if "mm" not in op and "neg" not in op}
    assert sum(elementwise.values()) <= 1e-6 * found.checked_values, elementwise


def test_flush_to_zero_is_restored_after_the_kernel(one_thread):
    xs = make_inputs(128)
    assert not flush_denormals_enabled()
    o, _ = chunk_kda(*xs, chunk_size=64)
    assert not flush_denormals_enabled()
    o.sum().backward()
    assert not flush_denormals_enabled()
    with flush_denormals():
        assert flush_denormals_enabled()
        chunk_kda(*xs, chunk_size=64)[0].sum().backward()
        assert flush_denormals_enabled()  # a caller's own setting stays on
    assert not flush_denormals_enabled()


class _no_flush:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
