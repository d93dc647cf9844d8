"""The checks issue 35 added to bench/gpu.sh (bench/gpu_check.py runs them with its own): host syncs per train step,
MLA over packed documents (FlexAttention vs per-document SDPA) and the routed experts as grouped_mm vs a GEMM loop.
Each returns table rows; on CPU (the dry run) each runs its code at toy sizes and the numbers mean nothing."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterator

import torch

from bench import probes
from bench.common import time_fn


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def count_syncs(fn: Callable[[], Any], dev: str) -> int:
    """Host syncs of one call of `fn`: on CUDA the warnings of `torch.cuda.set_sync_debug_mode("warn")` (every
    synchronising CUDA call), on CPU the host-read ops bench/probes.py counts (the sync-budget tests' counter)."""
    if dev != "cuda":
        with probes.count_syncs() as counter:
            fn()
        return counter.total
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


def versus(base: tuple[str, Any, str], other: tuple[str, Any, str], speedup: str) -> list[dict[str, Any]]:
    """Two timed rows (check, time_fn result, note) and the speed-up of `other` over `base`, measured in one run."""
    rows = [
        {"check": check, "value": t.median * 1e3, "unit": "ms", "spread": t.spread, "note": note}
        for check, t, note in (base, other)
    ]
    speed = {"check": speedup, "value": base[1].median / other[1].median, "unit": "x", "note": "same inputs, same run"}
    return [*rows, speed]


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
    return versus(
        (
            f"MLA packed per-document SDPA bf16 {what} T={T}",
            t_d,
            f"{docs} documents, {preset} dims (qk {cfg.mla_q_head_dim}, v {cfg.v_head_dim})",
        ),
        (
            f"MLA packed flex bf16 {what} T={T}",
            t_f,
            f"rel err vs per-document {err:.1e} ({'OK' if err < 2e-2 else 'MISMATCH'})",
        ),
        "MLA packed flex speed-up over per-document",
    )


def expert_check(seq: int, batch: int, reps: int, dev: str, preset: str) -> list[dict[str, Any]]:
    """The whole model's bf16 fwd+bwd with the routed experts as one grouped_mm per projection vs a loop of GEMMs
    (`model.expert_backend`, `K3ForCausalLM.set_expert_backend`): the difference is the experts' share."""
    from model import K3Config, K3ForCausalLM

    cfg = K3Config.preset(preset)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the dry run: fp32 (CPU bf16 GEMMs are slow)
    model = K3ForCausalLM(cfg).to(dev, dtype).train()
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
    return versus(
        (f"{preset} fwd+bwd bf16 experts loop B={batch} T={seq}", t_loop, f"loss {l_loop:.4f}"),
        (
            f"{preset} fwd+bwd bf16 experts grouped_mm B={batch} T={seq}",
            t_g,
            f"loss {l_g:.4f} (rel diff {abs(l_g - l_loop) / abs(l_loop):.1e})",
        ),
        "experts grouped_mm speed-up over loop (whole step)",
    )


def sync_check(seq: int, dev: str, preset: str) -> list[dict[str, Any]]:
    """Host syncs of one bf16 train step (fwd, bwd, AdamW, balancer update), unpacked rows and one packed row.
    The CPU dry run counts in fp32 (CPU bf16 GEMMs are slow; the counted ops do not depend on the dtype) and
    without the warm-up step (nothing is compiled there)."""
    from model import K3Config, K3ForCausalLM
    from training import balance

    cfg = K3Config.preset(preset)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=dev)
    cu = doc_cu(seq, dev)
    rows = []
    cases = [("unpacked", {})] if dev == "cuda" else []  # the dry run: the packed row only (a superset of reads)
    # packed: the loader's host copy of the boundaries travels beside the device tensor, as in training/step.py
    packed = {"cu_seqlens": cu, "cu_seqlens_cpu": cu.cpu()}
    for name, kwargs in [*cases, (f"packed ({len(cu) - 1} docs)", packed)]:

        def step(kwargs: dict[str, Any] = kwargs) -> None:
            out = model(ids, labels=ids, **kwargs)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            balance.apply(model.moe_layers(), [s.balance for s in out.router_stats])  # the trainer's one read

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
