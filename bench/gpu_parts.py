"""The checks issue 35 added to bench/gpu.sh (bench/gpu_check.py runs them with its own): host syncs per train step,
MLA over packed documents (FlexAttention vs per-document SDPA) and the routed experts as grouped_mm vs a GEMM loop.
Each returns table rows; on CPU (the dry run) each runs its code at toy sizes and the numbers mean nothing."""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import time_fn


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


SYNC_OPS = ("_local_scalar_dense", "nonzero", "bincount", "repeat_interleave")


class _HostReadOps(TorchDispatchMode):
    """CPU stand-in for CUDA's sync debug mode: counts the ops that read device values on the host
    (`_local_scalar_dense` behind .item()/float()/bool(), nonzero, bincount, repeat_interleave) and Tensor.tolist."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name.split("::")[-1] in SYNC_OPS
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(t):
            self.count += 1
            return self._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def count_syncs(fn: Callable[[], Any], dev: str) -> int:
    """Host syncs of one call of `fn`: on CUDA the warnings of `torch.cuda.set_sync_debug_mode("warn")` (every
    synchronising CUDA call), on CPU the host-read ops above."""
    if dev != "cuda":
        with _HostReadOps() as rec:
            fn()
        return rec.count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@contextlib.contextmanager
def packed_attention(backend: str) -> Iterator[None]:
    """Select model/attention_backend.py's packed-document path for the block (its one override)."""
    saved = os.environ.get("K3_PACKED_ATTENTION")
    os.environ["K3_PACKED_ATTENTION"] = backend
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("K3_PACKED_ATTENTION", None)
        else:
            os.environ["K3_PACKED_ATTENTION"] = saved


def doc_cu(total: int, dev: str) -> torch.Tensor:
    """Documents of mixed odd lengths filling `total` tokens: a quarter of the row, then halving down to 1/16."""
    lens, left, n = [], total, max(1, total // 4)
    while left > 0:
        lens.append(min(n | 1, left))
        left -= lens[-1]
        n = max(n // 2, total // 16, 1)
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)


def mla_check(T: int, reps: int, dev: str, preset: str) -> list[dict[str, Any]]:
    """One MLA layer over a packed row: FlexAttention with a document block mask (CUDA's path, one compiled call)
    vs one SDPA call per document (CPU's path), bf16 fwd+bwd, outputs and input gradients compared."""
    from model import K3Config
    from model.mla import GatedMLA

    cfg = K3Config.preset(preset)
    torch.manual_seed(0)
    m = GatedMLA(cfg, layer_idx=3).to(dev, torch.bfloat16)
    cu = doc_cu(T, dev)
    host = cu.tolist()
    x = torch.randn(1, T, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    backward = dev == "cuda"  # CPU FlexAttention has no backward (torch 2.13): forward only in the dry run
    res: dict[str, Any] = {}
    for backend in ("per_document", "flex"):
        xi = x.clone().requires_grad_(backward)

        def step(xi: torch.Tensor = xi) -> torch.Tensor:
            with packed_attention(backend), torch.set_grad_enabled(backward):
                y = m(xi, cu, cu_seqlens_host=host)
                if backward:
                    xi.grad = None
                    y.float().square().mean().backward()
            return y

        y = step()  # the warm-up call (compiles flex on CUDA); time_fn needs none after it
        res[backend] = (y.detach(), None if not backward else xi.grad.detach().clone(), time_fn(step, reps, warmup=0))
    (y_d, g_d, t_d), (y_f, g_f, t_f) = res["per_document"], res["flex"]
    err = rel_err(y_f, y_d) if g_d is None else max(rel_err(y_f, y_d), rel_err(g_f, g_d))
    what = "fwd+bwd" if backward else "fwd"
    docs = len(host) - 1
    return [
        {
            "check": f"MLA packed per-document SDPA bf16 {what} T={T}",
            "value": t_d.median * 1e3,
            "unit": "ms",
            "spread": t_d.spread,
            "note": f"{docs} documents, {preset} dims (qk {cfg.mla_q_head_dim}, v {cfg.v_head_dim})",
        },
        {
            "check": f"MLA packed flex bf16 {what} T={T}",
            "value": t_f.median * 1e3,
            "unit": "ms",
            "spread": t_f.spread,
            "note": f"rel err vs per-document {err:.1e} ({'OK' if err < 2e-2 else 'MISMATCH'})",
        },
        {
            "check": "MLA packed flex speed-up over per-document",
            "value": t_d.median / t_f.median,
            "unit": "x",
            "note": "same inputs, same run",
        },
    ]


def expert_check(seq: int, batch: int, reps: int, dev: str, preset: str) -> list[dict[str, Any]]:
    """The whole model's bf16 fwd+bwd with the routed experts as one grouped_mm per projection vs a loop of GEMMs
    (`model.expert_backend`, `K3ForCausalLM.set_expert_backend`): the difference is the experts' share."""
    from model import K3Config, K3ForCausalLM

    cfg = K3Config.preset(preset)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the dry run: fp32 (CPU bf16 GEMMs are slow)
    model = K3ForCausalLM(cfg).to(dev, dtype).train()
    if not hasattr(model, "set_expert_backend"):
        return [
            {
                "check": "experts grouped_mm vs loop",
                "value": None,
                "unit": "",
                "note": "skipped: this checkout has no model.expert_backend (K3ForCausalLM.set_expert_backend)",
            }
        ]
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    res = {}
    for name in ("loop", "grouped_mm"):
        model.set_expert_backend(name)

        def step() -> torch.Tensor:
            model.zero_grad(set_to_none=True)
            out = model(ids, labels=ids)
            out.loss.backward()
            return out.loss.detach()

        loss = step()  # the warm-up call
        res[name] = (float(loss), time_fn(step, reps, warmup=0))
    (l_loop, t_loop), (l_g, t_g) = res["loop"], res["grouped_mm"]
    return [
        {
            "check": f"{preset} fwd+bwd bf16 experts loop B={batch} T={seq}",
            "value": t_loop.median * 1e3,
            "unit": "ms",
            "spread": t_loop.spread,
            "note": f"loss {l_loop:.4f}",
        },
        {
            "check": f"{preset} fwd+bwd bf16 experts grouped_mm B={batch} T={seq}",
            "value": t_g.median * 1e3,
            "unit": "ms",
            "spread": t_g.spread,
            "note": f"loss {l_g:.4f} (rel diff {abs(l_g - l_loop) / abs(l_loop):.1e})",
        },
        {
            "check": "experts grouped_mm speed-up over loop (whole step)",
            "value": t_loop.median / t_g.median,
            "unit": "x",
            "note": "same inputs, same run",
        },
    ]


def sync_check(seq: int, dev: str, preset: str) -> list[dict[str, Any]]:
    """Host syncs of one bf16 train step (fwd, bwd, AdamW, balancer update), unpacked rows and one packed row.
    The CPU dry run counts in fp32 (CPU bf16 GEMMs are slow; the counted ops do not depend on the dtype) and
    without the warm-up step (nothing is compiled there)."""
    from model import K3Config, K3ForCausalLM

    cfg = K3Config.preset(preset)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=dev)
    cu = doc_cu(seq, dev)
    rows = []
    cases = [("unpacked", {})] if dev == "cuda" else []  # the dry run: the packed row only (a superset of reads)
    for name, kwargs in [*cases, (f"packed ({len(cu) - 1} docs)", {"cu_seqlens": cu})]:
        if kwargs and "cu_seqlens_host" in inspect.signature(model.forward).parameters:
            kwargs["cu_seqlens_host"] = cu.tolist()  # the host copy, when the model takes it (read once per batch)

        def step(kwargs: dict[str, Any] = kwargs) -> None:
            out = model(ids, labels=ids, **kwargs)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for moe, s in zip(model.moe_layers(), out.router_stats):
                moe.balancer.update(s.balance)

        if dev == "cuda":
            step()  # warm-up: lazy state, compiled kernels (FlexAttention), cuBLAS handles
        n = count_syncs(step, dev)
        how = "torch.cuda.set_sync_debug_mode" if dev == "cuda" else "host-read ops (CPU stand-in)"
        rows.append(
            {
                "check": f"{preset} host syncs per train step, {name} T={seq}",
                "value": float(n),
                "unit": "syncs",
                "note": how,
            }
        )
    return rows
