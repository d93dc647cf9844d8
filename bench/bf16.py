"""bf16 as on the GPU, on CPU (issue 35 part 4): the smoke model's loss curve in `train.precision=bf16` vs fp32.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.bf16                  # 50 steps each, a few minutes on 2 cores
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.bf16 --steps 2        # a quick look

Two real 1-process runs of `experiment=smoke parallel=dp deepspeed=zero1` (the smoke model, 2 layers: one KDA, one
MLA; a MoE layer with Quantile Balancing; the embedded corpus), same seed, differing only in `train.precision`. In
bf16 DeepSpeed casts the module to bf16 and keeps fp32 master weights and fp32 gradient accumulation
(`BF16_Optimizer`, ZeRO-1), exactly its GPU path; scores, softmaxes, norms, gates, the router, SiTU and the loss
stay in fp32 inside the model (tests/training/test_bf16.py names each place). Reported: the losses every 10 steps,
the largest relative gap |bf16 - fp32| / fp32 over all steps and over a 10-step moving average (the goal: within
2%), and each run's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(precision: str, steps: int, run_dir: Path) -> tuple[list[float], float]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "training.train",
        "experiment=smoke",
        "parallel=dp",
        "deepspeed=zero1",
        f"train.precision={precision}",
        f"train.steps={steps}",
        "logging.every=1",
        "logging.mode=disabled",
        "checkpoint.every=0",
        f"run_dir={run_dir}",
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["loss"]) for r in rows if "loss" in r], seconds


def moving_average(xs: list[float], n: int) -> list[float]:
    return [sum(xs[max(0, i - n + 1) : i + 1]) / len(xs[max(0, i - n + 1) : i + 1]) for i in range(len(xs))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.common import print_table, write_json
    from bench.qk_clip_memory import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        curves, seconds = {}, {}
        for precision in ("fp32", "bf16"):
            curves[precision], seconds[precision] = run(precision, args.steps, Path(tmp) / precision)
    fp32, bf16 = curves["fp32"], curves["bf16"]
    n = min(len(fp32), len(bf16))
    gap = [abs(bf16[i] - fp32[i]) / abs(fp32[i]) for i in range(n)]
    avg32, avg16 = moving_average(fp32[:n], 10), moving_average(bf16[:n], 10)
    gap_avg = [abs(a - b) / abs(a) for a, b in zip(avg32, avg16)]
    every = sorted({*range(0, n, 10), n - 1})
    rows = [{"step": i + 1, "fp32": fp32[i], "bf16": bf16[i], "rel_gap": gap[i]} for i in every]
    cpu = cpu_model()
    print_table(f"smoke model, 1 process, ZeRO-1, loss bf16 vs fp32 ({cpu})", rows)
    summary = {
        "steps": n,
        "max_rel_gap": max(gap),
        "max_rel_gap_10step_avg": max(gap_avg),
        "final_fp32": fp32[n - 1],
        "final_bf16": bf16[n - 1],
        "fp32_run_s": seconds["fp32"],
        "bf16_run_s": seconds["bf16"],
        "within_2pct": max(gap_avg) <= 0.02,
    }
    print_table("summary", [summary])
    out = {"cpu_model": cpu, "summary": summary, "fp32": fp32, "bf16": bf16}
    write_json("bf16", out)
    return out


if __name__ == "__main__":
    main()
