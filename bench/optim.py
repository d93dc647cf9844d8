"""Muon's train-step time on DeepSpeed's ZeRO-2 Muon vs the ZeRO-0 path, with AdamW at both stages as the peer.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=2 .venv/bin/python -m bench.optim                 # small, seq 256
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.optim --preset tiny --seq-len 64 --reps 1

One step is the trainer's own (`Trainer.train_step`: forward, backward, optimizer step, balancers), one process,
fp32, batch 1, in the same run for every case (`optim=muon|adamw` x `deepspeed=zero0|zero2`). Under ZeRO-2 the
Newton-Schulz work runs while DeepSpeed builds the gradient partition (training/optim/muon.py), so only whole steps
compare; `muon - adamw` at the same stage is Muon's cost. The last row is AdamW + ZeRO-2 with `model.mtp_depth=1`:
its `vs_adamw_same_stage` is MTP's step-time cost (one more MLA + MoE block, one more lm_head + CE). Cases run one
after another (one model in memory at a time), so load on a shared machine moves them unevenly: read the ratios.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from typing import Any

from bench.common import print_table, time_fn, write_json
from bench.train import build_trainer, trainer_step

CASES = (("muon", 0, 0), ("muon", 2, 0), ("adamw", 0, 0), ("adamw", 2, 0), ("adamw", 2, 1))  # optim, ZeRO, MTP


def run_case(preset: str, seq_len: int, optim: str, stage: int, reps: int, mtp: int = 0) -> dict[str, Any]:
    extra = [f"optim={optim}", f"deepspeed=zero{stage}", "train.grad_clip=0", f"model.mtp_depth={mtp}"]
    with tempfile.TemporaryDirectory(prefix="k3-bench-optim-") as run_dir:
        trainer = build_trainer(preset, seq_len, run_dir, extra)
        t = time_fn(trainer_step(trainer), reps=reps, warmup=1)
        del trainer
        gc.collect()
    return {"optim": optim, "zero": stage, "mtp_depth": mtp, "step_s": t.median, "step_s_min": t.min}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    rows = [run_case(args.preset, args.seq_len, o, z, args.reps, d) for o, z, d in CASES]
    by = {(r["optim"], r["zero"], r["mtp_depth"]): r["step_s"] for r in rows}
    for r in rows:  # the MTP row's ratios: its cost over the same step without MTP (mtp_depth=1 / 0)
        r["vs_adamw_same_stage"] = r["step_s"] / by[("adamw", r["zero"], 0)]
        r["vs_zero0_same_optim"] = r["step_s"] / by[(r["optim"], 0, r["mtp_depth"])] if r["mtp_depth"] == 0 else None
    print_table(f"train step, {args.preset}, seq {args.seq_len}, batch 1, 1 process, fp32", rows)
    payload = {"preset": args.preset, "seq_len": args.seq_len, "reps": args.reps, "rows": rows}
    write_json(f"optim_{args.preset}", payload)
    return payload


if __name__ == "__main__":
    main()
