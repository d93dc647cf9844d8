"""Loss after equal tokens, Muon vs AdamW, on the smoke job (median over init seeds), in one run.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.optim_loss                       # 300 steps, seeds 0 1 2
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.optim_loss --steps 20 --seeds 0

Each case is the README's main job as a user runs it (`python -m training.launch experiment=smoke`: 2 CPU ranks,
EP=2 + ZeRO-2, tiny K3, the embedded corpus) with `optim=muon` or `optim=adamw` and `train.seed=S` (the seed of
the parameter init; the data stream is the same for every case), so both optimizers see the same tokens in the
same order. Muon's step is K2's RMS-matched one (`optim.muon_lr_scale=rms`, muon_lr = lr), so the two share the
smoke job's learning rate and schedule: no per-optimizer tuning. Reported per case: `final_loss_avg` (the mean
loss of the last logging window, summary.json), the first-window loss and the held-out loss at the last step (the
smoke job's `eval/heldout/loss`: the 2% of the corpus it never trains on); per optimizer the medians over seeds;
and Muon's medians relative to AdamW's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
OPTIMS = ("adamw", "muon")
HELDOUT = "eval/heldout/loss"  # the smoke job evaluates its corpus' held-out 2% (at the last step too)


def run_job(optim: str, seed: int, steps: int, run_dir: Path) -> dict[str, Any]:
    """One smoke job through the launcher; its summary.json."""
    cmd = [
        sys.executable,
        "-m",
        "training.launch",
        "experiment=smoke",
        f"optim={optim}",
        f"train.seed={seed}",
        f"train.steps={steps}",
        "checkpoint.every=0",
        "logging.mode=disabled",
        "eval.on_start=false",  # the fresh model scores the same under either optimizer: only the trained one counts
        f"run_dir={run_dir}",
    ]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"error: the {optim} seed-{seed} job failed (rc={p.returncode}):\n{p.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if HELDOUT in r]
    summary["heldout_loss"] = evals[-1][HELDOUT] if evals else float("nan")  # the last step's held-out loss
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="train.steps of every job (the smoke job's own: 300)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="k3-bench-optim-loss-") as tmp:
        for seed in args.seeds:  # seeds outermost: a load change on the machine hits both optimizers alike
            for optim in OPTIMS:
                s = run_job(optim, seed, args.steps, Path(tmp) / f"{optim}-{seed}")
                rows.append(
                    {
                        "optim": optim,
                        "seed": seed,
                        "tokens": s["tokens_seen"],
                        "first_loss_avg": s["first_loss_avg"],
                        "final_loss_avg": s["final_loss_avg"],
                        "heldout_loss": s["heldout_loss"],
                        "elapsed_s": s["elapsed_s"],
                    }
                )
    median = {o: statistics.median(r["final_loss_avg"] for r in rows if r["optim"] == o) for o in OPTIMS}
    held = {o: statistics.median(r["heldout_loss"] for r in rows if r["optim"] == o) for o in OPTIMS}
    summary = [
        {
            "optim": o,
            "seeds": len(args.seeds),
            "median_final_loss": median[o],
            "vs_adamw": median[o] / median["adamw"],
            "median_heldout_loss": held[o],
            "heldout_vs_adamw": held[o] / held["adamw"],
            "median_elapsed_s": statistics.median(r["elapsed_s"] for r in rows if r["optim"] == o),
        }
        for o in OPTIMS
    ]
    print_table(f"smoke job, {args.steps} steps: loss after equal tokens", rows)
    print_table("median over seeds", summary)
    payload = {"steps": args.steps, "seeds": args.seeds, "runs": rows, "summary": summary}
    print(f"wrote {write_json('optim_loss', payload)}")
    return payload


if __name__ == "__main__":
    main()
