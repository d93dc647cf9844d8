"""The one-GPU check behind bench/gpu.sh: host syncs per train step, fla KDA vs the chunked PyTorch path, MLA over
packed documents (flex vs per-document), routed experts grouped_mm vs loop, small-preset bf16 train-step time and
MFU, peak memory vs the planner. Every part is guarded, so one failure still leaves the others and the final table.

    bench/gpu.sh                                  # what to run on the GPU (checks CUDA first, <= 5 min)
    python -m bench.gpu_check --seq 4096 --batch 4 --steps 6

Numbers: host syncs of one bf16 train step of the small preset at T=--seq, one unpacked row and one packed row of
mixed documents (`torch.cuda.set_sync_debug_mode("warn")` warnings; bench/gpu_parts.py). KDA fwd+bwd medians (B=1,
T=8192, H=16, K=V=128, bf16 inputs); correctness as relative L2 error of o and of every input gradient vs the
PyTorch chunked path in fp32. MLA: one small-preset layer (qk 192, v 128) over a packed row of --mla-seq tokens
(default --seq: the compiled flex kernel of the sync row's packed step is reused),
bf16 fwd+bwd, compiled FlexAttention vs one SDPA call per document, outputs and input gradients compared. Experts:
the small model's bf16 fwd+bwd at B=1, T=--seq with `set_expert_backend("grouped_mm")` vs `("loop")`. Train step:
small preset, bf16 weights and AdamW (what DeepSpeed's bf16 mode computes with), MFU = model FLOPs
(training.metrics.flops_per_token) per second over the datasheet dense bf16 peak (training.metrics.system.
GPU_PEAK_BF16), and over a 8192^3 bf16 matmul measured in the same run. Peak memory: torch.cuda.max_memory_allocated
vs training.plan (ZeRO-0, 1 GPU, bf16, flash). `--cpu-dry-run` runs every part's code on CPU at toy sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from typing import Any, Callable, Iterator

import torch

from bench.common import format_table, machine_info, peak_matmul_flops, time_fn, write_json
from bench.gpu_parts import expert_check, mla_check, rel_err, sync_check


@contextlib.contextmanager
def pytorch_kda_path() -> Iterator[None]:
    """Force model.kda.ops onto its chunked PyTorch path even when fla is importable."""
    import model.kda.ops as ops

    saved = ops._use_fla
    ops._use_fla = lambda x: False
    try:
        yield
    finally:
        ops._use_fla = saved


def kda_check(T: int, H: int, K: int, reps: int, dev: str = "cuda") -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from model.kda.ops import _fla_kda, chunk_kda

    gen = torch.Generator(device=dev).manual_seed(0)
    q = F.normalize(torch.randn(1, T, H, K, device=dev, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, device=dev, generator=gen), dim=-1)
    v = torch.randn(1, T, H, K, device=dev, generator=gen)
    g = -5.0 * torch.rand(1, T, H, K, device=dev, generator=gen)  # K3's gate bound
    beta = torch.rand(1, T, H, device=dev, generator=gen)
    do = torch.randn(1, T, H, K, device=dev, generator=gen)

    def run(dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor], Callable[[], None]]:
        xs = [x.detach().to(dtype).clone().requires_grad_() for x in (q, k, v, g, beta)]

        def step() -> None:
            for x in xs:
                x.grad = None
            o, _ = chunk_kda(*xs)
            (o.float() * do).sum().backward()

        o, _ = chunk_kda(*xs)
        (o.float() * do).sum().backward()
        return o.detach(), [x.grad.detach().clone() for x in xs], step

    with pytorch_kda_path():
        o_ref, g_ref, _ = run(torch.float32)
        o_pt, g_pt, step_pt = run(torch.bfloat16)
        t_pt = time_fn(step_pt, reps=reps, warmup=1)
    rows = [
        {
            "check": f"KDA torch-chunk bf16 fwd+bwd T={T} H={H} K={K}",
            "value": t_pt.median * 1e3,
            "unit": "ms",
            "spread": t_pt.spread,
            "note": f"err o {rel_err(o_pt, o_ref):.1e}, grads max "
            f"{max(rel_err(a, b) for a, b in zip(g_pt, g_ref)):.1e} vs fp32",
        }
    ]
    if _fla_kda() is None:
        rows.append(
            {
                "check": "KDA fla kernel",
                "value": None,
                "unit": "",
                "note": "fla not importable (pip install flash-linear-attention; needs triton): skipped",
            }
        )
        return rows
    o_fla, g_fla, step_fla = run(torch.bfloat16)  # chunk_kda dispatches to fla for CUDA bf16 tensors
    t_fla = time_fn(step_fla, reps=reps, warmup=1)
    errs = [rel_err(o_fla, o_ref)] + [rel_err(a, b) for a, b in zip(g_fla, g_ref)]
    rows.append(
        {
            "check": f"KDA fla bf16 fwd+bwd T={T} H={H} K={K}",
            "value": t_fla.median * 1e3,
            "unit": "ms",
            "spread": t_fla.spread,
            "note": f"err o {errs[0]:.1e}, grads max {max(errs[1:]):.1e} vs fp32; "
            f"{'OK' if max(errs) < 3e-2 else 'MISMATCH'}",
        }
    )
    rows.append(
        {
            "check": "KDA fla speed-up over torch-chunk",
            "value": t_pt.median / t_fla.median,
            "unit": "x",
            "note": "same inputs, same run",
        }
    )
    return rows


def train_check(seq: int, batch: int, steps: int, dev: str = "cuda", preset: str = "small") -> list[dict[str, Any]]:
    from model import K3Config, K3ForCausalLM
    from training.metrics.flops import flops_per_token
    from training.metrics.system import gpu_peak_flops
    from training.tools.plan import Hardware, Layout, peak_bytes, plan

    cfg = K3Config.preset(preset)
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(dev, torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)

    def step() -> float:
        """The model's share of a training step in bf16 (bench/train.py times the full trainer step on CPU)."""
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for moe, s in zip(model.moe_layers(), out.router_stats):
            moe.balancer.update(s.balance)
        return float(out.loss.detach())

    cuda = dev == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time_fn(step, reps=steps, warmup=1)
    peak_mem = torch.cuda.max_memory_allocated() if cuda else float("nan")
    tok_s = batch * seq / t.median
    fpt = flops_per_token(cfg, seq)
    sheet = (gpu_peak_flops(torch.cuda.get_device_name(0)) or 0.0) if cuda else 0.0
    n_mm = 8192 if cuda else 512
    measured = peak_matmul_flops(n_mm, reps=5, dtype=torch.bfloat16, device=dev)
    est = plan(
        cfg,
        Layout(zero_stage=0, micro_batch_size=batch, seq_len=seq, precision="bf16", reduce_bucket_size=0),
        Hardware(nodes=1, gpus_per_node=1, reserve_gb=0.0, attention="flash"),
    )
    # the planner counts fp32 master weights + Adam state (12 B/param); this check keeps bf16 AdamW state (4 B) and,
    # as plain PyTorch with set_to_none, creates the gradients during backward (they do not persist)
    n = sum(p.numel() for p in model.parameters())
    terms = {k: v * 1e9 for k, v in est["gpu_memory_gb"].items() if k != "total"} | {"optimizer": n * 4.0}
    est_b = peak_bytes(terms, grads_persist=False)
    return [
        {
            "check": f"{preset} train step bf16 B={batch} T={seq}",
            "value": t.median,
            "unit": "s",
            "spread": t.spread,
            "note": f"{tok_s:,.0f} tokens/s",
        },
        {
            "check": f"{preset} MFU vs datasheet bf16 peak",
            "value": tok_s * fpt / sheet if sheet else None,
            "unit": "",
            "note": f"goal >= 0.45; peak {sheet / 1e12:.0f} TFLOP/s" if sheet else "unknown device peak",
        },
        {
            "check": f"{preset} MFU vs measured bf16 matmul",
            "value": tok_s * fpt / measured,
            "unit": "",
            "note": f"{n_mm}^3 bf16 matmul {measured / 1e12:.3g} TFLOP/s",
        },
        {
            "check": f"{preset} peak memory",
            "value": peak_mem / 1e9,
            "unit": "GB",
            "note": f"planner {est_b / 1e9:.2f} GB (bf16 Adam state) -> ratio {peak_mem / est_b:.2f}",
        },
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--mla-seq", type=int, default=0, help="packed row length of the MLA check (0: --seq, one flex compile)"
    )
    ap.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="exercise the script's code on CPU at toy sizes (tiny preset); numbers mean nothing",
    )
    args = ap.parse_args(argv)
    dev, preset = ("cpu", "tiny") if args.cpu_dry_run else ("cuda", "small")
    if dev == "cuda" and not torch.cuda.is_available():
        print(
            f"error: no CUDA device (torch {torch.__version__}, cuda build {torch.version.cuda}); bench/gpu.sh "
            "needs one NVIDIA GPU and a CUDA build of torch (set PYTHON=...)",
            file=sys.stderr,
        )
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    mla_seq = args.mla_seq or (4 * args.seq if args.cpu_dry_run else args.seq)  # = the sync row's packed length
    for name, fn in (
        ("sync", lambda: sync_check(args.seq, dev, preset)),
        ("kda", lambda: kda_check(args.T, args.H, args.K, args.reps, dev)),
        ("mla", lambda: mla_check(mla_seq, args.reps, dev, preset)),
        ("experts", lambda: expert_check(args.seq, 1, args.steps, dev, preset)),
        ("train", lambda: train_check(args.seq, args.batch, args.steps, dev, preset)),
    ):
        try:
            rows += fn()
        except Exception as e:  # noqa: BLE001 - keep going: the table must still print
            traceback.print_exc()
            rows.append(
                {"check": f"{name} FAILED", "value": None, "unit": "", "note": f"{type(e).__name__}: {e}"[:150]}
            )
        if dev == "cuda":
            torch.cuda.empty_cache()
    info = machine_info()
    where = info["cuda"] or "CPU (dry run)"
    print(f"\nbench/gpu.sh on {where} (torch {info['torch']}), {info['date_utc']}, {time.time() - t0:.0f} s")
    print(format_table(rows, ["check", "value", "unit", "spread", "note"]), flush=True)
    payload = {"args": vars(args), "rows": rows}
    path = write_json("gpu_cpu_dry_run" if args.cpu_dry_run else "gpu", payload)
    if os.environ.get("OUT"):
        write_json("gpu", payload, os.environ["OUT"])
    print(f"wrote {path}")
    return 1 if any("FAILED" in r["check"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
