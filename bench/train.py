"""Train-step throughput on CPU: tokens/s, achieved FLOP/s and "CPU MFU" of the tiny and small presets.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.train                      # tiny 256..2048 + small 2048
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.train --cases tiny:256 --reps 2 --profile
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.train --cases small:2048 --threads 2

One step is the trainer's own step (`training.trainer.Trainer.train_step`: the loader's micro-batch, forward +
loss + backward through the DeepSpeed engine (ZeRO-0, fp32, client fused AdamW, nothing JIT-compiled), the
optimizer step, the guard, the balancers' global statistics and bias update), batch 1 (the CPU smoke layout), one
process. Achieved FLOP/s uses the trainer's own model FLOPs (`training.metrics.flops_per_token`: MFU, not HFU). The
denominator is a large fp32 matmul timed right before each case in the same process ("CPU MFU"): on a shared
machine both move with the load, their ratio less. `--profile` adds a torch.profiler table of the top self-CPU ops
of one step.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, Callable

import torch

from bench.common import peak_matmul_flops, print_table, time_fn, write_json
from training.config import compose, validate
from training.metrics.flops import flops_breakdown, flops_per_token
from training.trainer import Trainer

DEFAULT_CASES = ("tiny:256", "tiny:1024", "tiny:2048", "small:2048")


def build_trainer(preset: str, seq_len: int, run_dir: str, extra: list[str] | None = None) -> Trainer:
    """The real trainer for one preset and sequence length: 1 process, ZeRO-0, batch 1, no logging."""
    cfg = compose(
        [
            f"model={preset}",
            f"train.seq_len={seq_len}",
            "train.micro_batch_size=1",
            "train.grad_accum=1",
            "deepspeed=zero0",
            "logging=disabled",
            "checkpoint.resume=none",
            f"run_dir={run_dir}",
            f"model.max_position_embeddings={max(seq_len, 4096)}",
            *(extra or []),
        ]
    )
    return Trainer(cfg, validate(cfg, 1))


def trainer_step(trainer: Trainer) -> Callable[[], float]:
    """One optimizer step of `trainer`, returning its loss (the one host sync a trainer does anyway)."""

    def step() -> float:
        return trainer.train_step().loss

    return step


def profile_step(step: Callable[[], Any], top: int = 15) -> list[dict[str, Any]]:
    """Top ops by self CPU time of one step (torch.profiler), as rows for the table and JSON."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [
        {
            "op": e.key[:48],
            "calls": e.count,
            "self_ms": e.self_cpu_time_total / 1e3,
            "share": e.self_cpu_time_total / total,
        }
        for e in events[:top]
    ]


def run_case(preset: str, seq_len: int, reps: int, profile: bool, run_dir: str) -> dict[str, Any]:
    trainer = build_trainer(preset, seq_len, run_dir)
    model, cfg = trainer.module, trainer.mcfg
    step = trainer_step(trainer)
    fpt = flops_per_token(cfg, seq_len, training=True)
    peak = peak_matmul_flops(2048, reps=3)  # measured right before, same process, same load
    t = time_fn(step, reps=reps, warmup=1)
    tok_s = seq_len / t.median
    row: dict[str, Any] = {
        "preset": preset,
        "seq_len": seq_len,
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "step_s": t.median,
        "spread": t.spread,
        "tokens_s": tok_s,
        "GFLOP_tok": fpt / 1e9,
        "achieved_GFs": tok_s * fpt / 1e9,
        "peak_GFs": peak / 1e9,
        "cpu_mfu": tok_s * fpt / peak,
        "timing": t.as_dict(),
        "flops_breakdown_fwd": flops_breakdown(cfg, seq_len),
    }
    if profile:
        row["profile_top"] = profile_step(step)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="preset:seq_len items")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--profile", action="store_true", help="top ops of one step (torch.profiler)")
    ap.add_argument("--name", default="train", help="results file bench/results/<name>.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = []
    for case in args.cases:
        preset, _, seq = case.partition(":")
        if not seq.isdigit():
            raise SystemExit(f"--cases item {case!r} must be preset:seq_len, e.g. small:2048")
        with tempfile.TemporaryDirectory(prefix="k3-bench-train-") as run_dir:
            rows.append(run_case(preset, int(seq), args.reps, args.profile, run_dir))
        print_table(
            f"train step {case} (threads={args.threads})",
            rows[-1:],
            ["preset", "seq_len", "params_M", "step_s", "spread", "tokens_s", "achieved_GFs", "peak_GFs", "cpu_mfu"],
        )
        if args.profile:
            print_table(f"top self-CPU ops, one step of {case}", rows[-1]["profile_top"])
    print_table(
        "train step summary (CPU MFU = achieved model FLOP/s / large fp32 matmul FLOP/s, same run)",
        rows,
        ["preset", "seq_len", "step_s", "spread", "tokens_s", "achieved_GFs", "peak_GFs", "cpu_mfu"],
    )
    payload = {
        "threads": args.threads,
        "reps": args.reps,
        "goal": "cpu_mfu >= 0.40 for small at seq 2048",
        "rows": rows,
    }
    print(f"wrote {write_json(args.name, payload)}")
    return payload


if __name__ == "__main__":
    main()
