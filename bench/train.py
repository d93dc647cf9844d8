"""Train-step throughput on CPU: tokens/s, achieved FLOP/s and "CPU MFU" of the tiny and small presets.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.train                      # tiny 256..2048 + small 2048
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.train --cases tiny:256 --reps 2 --profile
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.train --cases small:2048 --threads 2 --deepspeed

One step = forward + loss + backward + AdamW + `update_balance()` (what the trainer does per micro-batch with
grad_accum 1), fp32, batch 1 (the CPU smoke layout), one process. Achieved FLOP/s uses the trainer's own model
FLOPs (`training.metrics.flops_per_token`: MFU, not HFU). The denominator is a large fp32 matmul timed right
before each case in the same process ("CPU MFU"): on a shared machine both move with the load, their ratio less.
`--profile` adds a torch.profiler table of the top self-CPU ops of one step; `--deepspeed` also times the same
step through a 1-rank DeepSpeed engine (ZeRO-0, torch AdamW, nothing JIT-compiled).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch

from bench.common import peak_matmul_flops, print_table, time_fn, write_json
from model import K3Config, K3ForCausalLM
from training.metrics.flops import flops_breakdown, flops_per_token

DEFAULT_CASES = ("tiny:256", "tiny:1024", "tiny:2048", "small:2048")


def build(preset: str, seed: int = 0) -> tuple[K3ForCausalLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = K3ForCausalLM(K3Config.preset(preset)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)  # as the trainer
    return model, opt


def make_step(model: K3ForCausalLM, opt: torch.optim.Optimizer, ids_BT: torch.Tensor) -> Callable[[], float]:
    """The trainer's step without DeepSpeed: fwd + CE, backward, AdamW, zero_grad, balance update."""
    def step() -> float:
        loss = model(ids_BT, labels=ids_BT).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_balance()
        return float(loss.detach())  # the one host sync a trainer does anyway (logging)
    return step


def make_deepspeed_step(model: K3ForCausalLM, ids_BT: torch.Tensor) -> Callable[[], float]:
    """The same step through a 1-rank DeepSpeed engine (ZeRO-0, fp32, client torch AdamW: no JIT builds)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": os.environ.get("MASTER_PORT", "29617")}.items():
        os.environ.setdefault(k, v)
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip the 37 s comm-op JIT build
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)  # as the trainer
    cfg = {"train_micro_batch_size_per_gpu": ids_BT.shape[0], "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def step() -> float:
        loss = engine(ids_BT, labels=ids_BT).loss
        engine.backward(loss)
        engine.step()
        model.update_balance()
        return float(loss.detach())
    return step


def profile_step(step: Callable[[], Any], top: int = 15) -> list[dict[str, Any]]:
    """Top ops by self CPU time of one step (torch.profiler), as rows for the table and JSON."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key[:48], "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in events[:top]]


def run_case(preset: str, seq_len: int, reps: int, deepspeed_too: bool, profile: bool) -> dict[str, Any]:
    model, opt = build(preset)
    cfg = model.config
    ids_BT = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    step = make_step(model, opt, ids_BT)
    fpt = flops_per_token(cfg, seq_len, training=True)
    peak = peak_matmul_flops(2048, reps=3)  # measured right before, same process, same load
    t = time_fn(step, reps=reps, warmup=1)
    tok_s = seq_len / t.median
    row: dict[str, Any] = {
        "preset": preset, "seq_len": seq_len, "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "step_s": t.median, "spread": t.spread, "tokens_s": tok_s, "GFLOP_tok": fpt / 1e9,
        "achieved_GFs": tok_s * fpt / 1e9, "peak_GFs": peak / 1e9, "cpu_mfu": tok_s * fpt / peak,
        "timing": t.as_dict(), "flops_breakdown_fwd": flops_breakdown(cfg, seq_len),
    }
    if profile:
        row["profile_top"] = profile_step(step)
    if deepspeed_too:
        ds_step = make_deepspeed_step(model, ids_BT)
        td = time_fn(ds_step, reps=reps, warmup=1)
        row.update(ds_step_s=td.median, ds_spread=td.spread, ds_over_plain=td.median / t.median,
                   ds_cpu_mfu=seq_len / td.median * fpt / peak)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="preset:seq_len items")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--deepspeed", action="store_true", help="also time the step through a DeepSpeed engine")
    ap.add_argument("--profile", action="store_true", help="top ops of one step (torch.profiler)")
    ap.add_argument("--name", default="train", help="results file bench/results/<name>.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for case in args.cases:
        preset, _, seq = case.partition(":")
        if not seq.isdigit():
            raise SystemExit(f"--cases item {case!r} must be preset:seq_len, e.g. small:2048")
        rows.append(run_case(preset, int(seq), args.reps, args.deepspeed, args.profile))
        print_table(f"train step {case} (threads={args.threads})", rows[-1:],
                    ["preset", "seq_len", "params_M", "step_s", "spread", "tokens_s", "achieved_GFs", "peak_GFs",
                     "cpu_mfu"] + (["ds_step_s", "ds_over_plain", "ds_cpu_mfu"] if args.deepspeed else []))
        if args.profile:
            print_table(f"top self-CPU ops, one step of {case}", rows[-1]["profile_top"])
    print_table("train step summary (CPU MFU = achieved model FLOP/s / large fp32 matmul FLOP/s, same run)", rows,
                ["preset", "seq_len", "step_s", "spread", "tokens_s", "achieved_GFs", "peak_GFs", "cpu_mfu"])
    payload = {"threads": args.threads, "reps": args.reps, "goal": "cpu_mfu >= 0.40 for small at seq 2048",
               "rows": rows}
    print(f"wrote {write_json(args.name, payload)}")
    return payload


if __name__ == "__main__":
    main()
