"""The chunked KDA kernel never computes on subnormal fp32 values (docs/performance.md, "Denormals"): x86 cores
take a microcode assist per subnormal operand, which made chunk 64 7x slower on an Intel Xeon. Checked here on
every machine by looking at the values, not the time: every aten op's output inside forward + backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from bench.kda import make_inputs
from bench.probes import find_subnormals
from model.kda.chunk import flush_denormals, flush_denormals_enabled
from model.kda.ops import chunk_kda


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count for the block, the previous one restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def one_thread():
    with threads(1):
        yield


@pytest.mark.parametrize("T, chunk_size, n_threads", [(512, 64, 1), (512, 32, 1), (256, 64, 2)])
def test_chunked_kda_intermediates_carry_no_subnormals(T, chunk_size, n_threads):
    """With any number of intra-op threads: the kernel's flush-to-zero covers only the calling thread (MXCSR is
    per thread; torch's OpenMP workers keep theirs), so what worker threads compute must be normal by
    construction. (Before the scaled UT transform, 2 threads left 4,799 subnormal values here.) One value in a
    million is allowed off the calling thread (and where there is no FTZ, off x86): an isolated product of a tiny
    gradient and a tiny factor, whose rounding depends on the machine's kernels."""
    xs = make_inputs(T)  # the bench's inputs: g at the K3 bound (-5, 0), where chunk 64 spans e^-315
    with threads(n_threads), find_subnormals() as found:
        o, _ = chunk_kda(*xs, chunk_size=chunk_size)
        o.sum().backward()
    assert found.checked > 100  # the probe saw the kernel's ops
    with flush_denormals():
        ftz = flush_denormals_enabled()  # x86: the calling thread flushes; elsewhere nothing does
    allowed = 0 if n_threads == 1 and ftz else 1e-6 * found.checked_values
    assert sum(found.values.values()) <= allowed, f"subnormal outputs ({found.values}) of {found.checked_values}"


def test_no_subnormals_without_flush_to_zero(monkeypatch, one_thread):
    """Whatever the thread's FTZ setting, the bench's inputs give no subnormal values, matmuls included: decay
    factors are flushed below 1e-30 and the UT transform runs scaled by 2^100 (model/kda/chunk.py, UT_SCALE).
    (Before: 17,241 subnormal values, in the UT transform's matmuls and what they fed; an isolated product of two
    tiny gradients may remain, hence one in a million.)"""
    monkeypatch.setattr("model.kda.chunk.flush_denormals", _no_flush)
    xs = make_inputs(256)
    with find_subnormals() as found:
        o, _ = chunk_kda(*xs, chunk_size=64)
        o.sum().backward()
    assert sum(found.values.values()) <= 1e-6 * found.checked_values, found.values


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
