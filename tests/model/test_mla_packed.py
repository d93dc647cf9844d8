"""Packed documents in MLA without the host (model/mla.py, model/attention_backend.py): QK-Clip's max logits per
document against a float64 dense-mask reference with no [T, T] tensor on any path, FlexAttention's document block
mask and values against the per-document path, and the host reads one forward makes."""

from __future__ import annotations

import copy
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.attention_backend import document_block_mask, packed_backend
from model.config import K3Config
from model.mla import GatedMLA, attention_mask, mla_max_logits
from tests.model.test_mtp_sequence import ThreadShard, _Hub

DN, DR, DV, R = 5, 3, 4, 6
MODEL_DIR = str(Path(__file__).resolve().parents[2] / "model")
SYNC_OPS = ("_local_scalar_dense", "nonzero", "bincount", "repeat_interleave")


def dense_max_logits_reference(q, c_kv, k_r, w_kvb, cu, scale):
    """float64 over the whole [T, S] score matrix and the old path's dense mask (same document, key <= query)."""
    B, T, H, _ = q.shape
    S = c_kv.shape[1]
    kv = (c_kv.double() @ w_kvb.double().T).view(B, S, H, DN + DV)
    k = torch.cat([kv[..., :DN], k_r.double()[:, :, None].expand(B, S, H, DR)], -1)
    s = torch.einsum("bthe,bshe->bhts", q.double(), k) * scale
    mask, _ = attention_mask(T, S, cu, torch.device("cpu"))
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if mask is None else mask
    return s.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])


CASES = {  # B, T, S, document lengths (None: unpacked), query chunk
    "unpacked": (2, 7, 7, None, 3),
    "cache_offset": (2, 5, 11, None, 2),
    "packed_odd": (1, 17, 17, [3, 0, 1, 5, 8], 4),
    "packed_long": (1, 61, 61, [13, 1, 29, 0, 18], 7),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("host", [True, False])
def test_max_logits_equal_the_dense_float64_reference(case, host):
    B, T, S, lens, chunk = CASES[case]
    g = torch.Generator().manual_seed(len(case) * 7 + T)
    H = 3
    q, c_kv, k_r = (torch.randn(*s, generator=g) for s in ((B, T, H, DN + DR), (B, S, R), (B, S, DR)))
    w = torch.randn(H * (DN + DV), R, generator=g)
    cu = None if lens is None else cu_of(lens)
    cu_host = cu.tolist() if cu is not None and host else None
    got = mla_max_logits(q, c_kv, k_r, w, DN, 0.3, cu, cu_host, chunk=chunk)
    torch.testing.assert_close(got.double(), dense_max_logits_reference(q, c_kv, k_r, w, cu, 0.3), rtol=1e-6, atol=0)


class OutputShapes(TorchDispatchMode):
    """Records every aten op's name and the shapes of its tensor outputs; a higher-order op (flex_attention) counts
    as one opaque kernel, as on CUDA, where it is one fused Triton kernel."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func._schema.name.split("::")[-1] if hasattr(func, "_schema") else str(func.name()))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def mla(heads: int = 3, **over) -> GatedMLA:
    dims = dict(qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV, kv_lora_rank=R) | over
    cfg = K3Config.preset(
        "tiny", hidden_size=16, num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=8, **dims
    )
    torch.manual_seed(1)
    return GatedMLA(cfg, layer_idx=3)


def has_t_by_t(shapes: list[tuple[int, ...]], T: int) -> bool:
    return any(sum(d >= T for d in s) >= 2 for s in shapes)


def test_tracked_packed_forward_builds_no_t_by_t_tensor(monkeypatch):
    """T = 512 in documents of <= 64 tokens, the CPU path, max-logit tracking on: no op output has two dimensions
    of size >= T (the old path built a [T, T] mask), with the host boundaries and without them."""
    monkeypatch.setenv("K3_PACKED_ATTENTION", "per_document")
    T, lens = 512, [64, 1, 63, 64, 0, 60, 4, 64, 64, 64, 64]
    cu = cu_of(lens)
    m = mla()
    m.track_max_logit = True
    x = torch.randn(1, T, 16)
    for host in (cu.tolist(), None):
        with OutputShapes() as rec:
            m(x, cu, cu_seqlens_host=host)
        assert rec.shapes and not has_t_by_t(rec.shapes, T)


def test_document_block_mask_equals_create_block_mask_and_makes_no_host_sync():
    from torch.nn.attention.flex_attention import create_block_mask

    for lens in ([100, 1, 0, 77, 122], [256], [129, 127, 400, 345], [1] * 130):
        T, cu = sum(lens), cu_of(lens)
        seg = torch.searchsorted(cu[1:], torch.arange(T), right=True)

        def doc_causal(b, h, q, kv):
            return (seg[q] == seg[kv]) & (kv <= q)

        want = create_block_mask(doc_causal, None, None, T, T, device="cpu")
        with OutputShapes() as rec:
            got = document_block_mask(cu, T)
        assert not set(rec.ops) & set(SYNC_OPS) and not has_t_by_t(rec.shapes, T)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks"):
            assert torch.equal(getattr(got, name).long(), getattr(want, name).long()), (lens, name)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_flex_forward_equals_per_document_with_qk_192_and_v_128(dtype, monkeypatch):
    """The small preset's MLA (qk head dim 192, v 128) over odd documents crossing 128-token blocks: CPU
    FlexAttention (eager forward; CPU flex has no backward) gives the per-document SDPA path's output."""
    cfg = K3Config.preset("small")
    assert (cfg.mla_q_head_dim, cfg.v_head_dim) == (192, 128)
    torch.manual_seed(0)
    m = GatedMLA(cfg, layer_idx=3).to(dtype)
    x, cu = torch.randn(1, 300, cfg.hidden_size, dtype=dtype), cu_of([3, 0, 130, 1, 166])
    out = {}
    for backend in ("per_document", "flex"):
        monkeypatch.setenv("K3_PACKED_ATTENTION", backend)
        with torch.no_grad():
            out[backend] = m(x, cu, cu_seqlens_host=cu.tolist())
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out["flex"], out["per_document"], rtol=tol, atol=tol)


def test_backend_choice_cuda_flex_cpu_per_document_and_override(monkeypatch):
    monkeypatch.delenv("K3_PACKED_ATTENTION", raising=False)
    assert packed_backend(torch.device("cpu")) == "per_document"
    assert packed_backend(torch.device("cuda")) == "flex"
    monkeypatch.setenv("K3_PACKED_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="K3_PACKED_ATTENTION='bogus'"):
        packed_backend(torch.device("cpu"))


class HostReads:
    """Counts host reads: `Tensor.tolist` / `Tensor.item` called from model/ by wrappers (eager CPU FlexAttention
    reads its scale inside its own compiled wrapper, which CUDA's compiled call does not) and, with `dispatch`, the
    sync ops (an op mode cannot hold eager CPU FlexAttention; its block mask is checked alone above)."""

    def __init__(self, dispatch: bool, where: str = MODEL_DIR) -> None:
        self.calls, self.mode, self.where = 0, OutputShapes() if dispatch else None, where

    def __enter__(self):
        self._orig = torch.Tensor.tolist, torch.Tensor.item

        def counting(fn):
            def wrapped(t):
                self.calls += self.where in sys._getframe(1).f_code.co_filename
                return fn(t)

            return wrapped

        torch.Tensor.tolist, torch.Tensor.item = (counting(f) for f in self._orig)
        if self.mode is not None:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)
        torch.Tensor.tolist, torch.Tensor.item = self._orig

    @property
    def count(self) -> int:
        return self.calls + (sum(op in SYNC_OPS for op in self.mode.ops) if self.mode is not None else 0)


@pytest.mark.parametrize("backend", ["per_document", "flex"])
def test_forward_reads_cu_seqlens_once_without_host_list_and_never_with_it(backend, monkeypatch):
    monkeypatch.setenv("K3_PACKED_ATTENTION", backend)
    m = mla()
    m.track_max_logit = True
    x, cu = torch.randn(1, 40, 16), cu_of([7, 0, 20, 13])
    host = cu.tolist()
    with torch.no_grad():  # CPU flex has a forward only
        with HostReads(dispatch=backend == "per_document") as given:
            m(x, cu, cu_seqlens_host=host)
        with HostReads(dispatch=backend == "per_document") as missing:
            m(x, cu)
    assert (given.count, missing.count) == (0, 1)


def test_sequence_parallel_max_logits_cover_own_heads_and_equal_the_whole_sequence():
    """2 thread ranks, 4 heads, documents crossing the shard edge: each rank reports its own 2 heads (-inf
    elsewhere); their MAX equals the unsharded layer's and the dense float64 reference."""
    whole = mla(heads=4).double()
    T, cu = 22, cu_of([9, 1, 12])
    x = torch.randn(1, T, 16, dtype=torch.float64)
    whole.track_max_logit = True
    whole(x, cu, cu_seqlens_host=cu.tolist())
    hub, shards = _Hub(2), [copy.deepcopy(whole) for _ in range(2)]

    def run(r: int) -> torch.Tensor:
        m = shards[r]
        m.sequence_shard, m.max_logit_H = ThreadShard(hub, r), None
        m(x[:, r * T // 2 : (r + 1) * T // 2], cu, cu_seqlens_host=cu.tolist())
        return m.max_logit_H

    with ThreadPoolExecutor(2) as pool:
        per_rank = list(pool.map(run, range(2)))
    for r, got in enumerate(per_rank):
        own = slice(2 * r, 2 * r + 2)
        assert torch.isinf(got).sum() == 2 and torch.equal(got[own], whole.max_logit_H[own])
    q = whole._query(x)
    c_kv, k_r = whole._latent(x)
    ref = dense_max_logits_reference(q, c_kv, k_r, whole.kv_b_proj.weight, cu, whole.scale)
    torch.testing.assert_close(torch.maximum(*per_rank), ref.float(), rtol=1e-6, atol=0)
