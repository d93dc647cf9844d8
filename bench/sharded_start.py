"""Sharded start: each rank's peak host memory from process start to the first optimizer step.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.sharded_start            # writes bench/results/sharded_start.json

An HF checkpoint of the `small` preset widened to 64 experts (random weights, several safetensors shards behind
an index) is the `model.init_from` of real training jobs (the Trainer of training/train.py, 1 optimizer step):
  * 1 process, deepspeed=zero0: the whole model, its gradients and AdamW state in one process;
  * 1 process, deepspeed=zero3: the same engine as the sharded job, world size 1;
  * 2 ranks through the deepspeed launcher, deepspeed=zero3 parallel.ep_size=2: the sharded start
    (training/parallel/construct.py) reads per rank only the rows it owns, ZeRO-3 keeps 1/2 of every dense tensor
    and each rank its 32 experts.
Each process reports its peak RSS (getrusage ru_maxrss: the whole life of the process up to the end of step 1,
imports included) and the checkpoint bytes it read; glibc runs with a fixed 128 KiB mmap threshold (as in
bench/memory.py) so RSS follows live tensors. Goal (issue 14): each rank <= 0.6x the single process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model=small", "model.num_experts=64"]
JOB = [
    *MODEL,
    "train.steps=1",
    "train.seq_len=128",
    "train.micro_batch_size=1",
    "logging=disabled",
    "checkpoint.save_final=false",
]
GB = 1e9


def worker(out: str, overrides: list[str]) -> None:
    """One rank: the trainer up to and including step 1, then its peak RSS and checkpoint bytes read."""
    sys.path.insert(0, str(ROOT))
    from training.config import compose, validate
    from training.distributed import env_world
    from training.trainer import Trainer

    cfg = compose(overrides)
    trainer = Trainer(cfg, validate(cfg, env_world().world_size))
    trainer.run()
    rec = {
        "rank": trainer.info.rank,
        "world": trainer.world,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
        "bytes_read_gb": trainer.ep.init_bytes_read / GB,
    }
    with open(f"{out}.rank{trainer.info.rank}.json", "w", encoding="utf-8") as f:
        json.dump(rec, f)


def make_checkpoint(path: Path) -> int:
    """Random `small`+64-expert HF checkpoint (1 GB shards); returns its tensor bytes."""
    import torch

    from model import K3ForCausalLM, save_hf_checkpoint
    from training.config import build_model_config, compose

    torch.manual_seed(0)
    model = K3ForCausalLM(build_model_config(compose(MODEL)))
    save_hf_checkpoint(model, path, max_shard_bytes=1 << 30)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def run(tmp: Path, name: str, nproc: int, overrides: list[str]) -> list[dict]:
    from training.launch import free_port, launch_command

    out = tmp / name
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        WANDB_MODE="disabled",
        PYTHONPATH=str(ROOT),
        MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"),
    )
    args = [__file__, "--worker", str(out), f"run_dir={tmp / (name + '_run')}", *overrides]
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [sys.executable, *args]
    else:
        env.pop("RANK", None)
        cmd = launch_command(args[1:], nproc, args[0])
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{name} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sharded_start.json"))
    a, rest = ap.parse_known_args()
    if a.worker:
        worker(a.worker, rest)
        return
    with tempfile.TemporaryDirectory(prefix="k3-sharded-") as d:
        tmp = Path(d)
        ckpt_bytes = make_checkpoint(tmp / "hf")
        init = [f"model.init_from={tmp / 'hf'}"]
        single = run(tmp, "one_process_zero0", 1, [*JOB, *init, "deepspeed=zero0"])[0]
        single3 = run(tmp, "one_process_zero3", 1, [*JOB, *init, "deepspeed=zero3"])[0]
        sharded = run(tmp, "zero3_ep2", 2, [*JOB, *init, "deepspeed=zero3", "parallel.ep_size=2"])
    vs0 = [r["peak_rss_gb"] / single["peak_rss_gb"] for r in sharded]
    vs3 = [r["peak_rss_gb"] / single3["peak_rss_gb"] for r in sharded]
    result = {
        "checkpoint_gb": ckpt_bytes / GB,
        "one_process_zero0": single,
        "one_process_zero3": single3,
        "zero3_ep2_ranks": sharded,
        "ratio_vs_zero0": vs0,
        "ratio_vs_zero3": vs3,
        "goal": 0.6,
        "meets_goal_vs_zero0": all(x <= 0.6 for x in vs0),
        "meets_goal_vs_zero3": all(x <= 0.6 for x in vs3),
    }
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"checkpoint {ckpt_bytes / GB:.2f} GB (small, 64 experts)")
    print(f"{'job':<24}{'peak RSS GB':>12}{'read GB':>10}{'x zero0':>9}{'x zero3':>9}")
    for name, r in (("1 process zero0", single), ("1 process zero3", single3)):
        print(
            f"{name:<24}{r['peak_rss_gb']:>12.2f}{r['bytes_read_gb']:>10.2f}"
            f"{r['peak_rss_gb'] / single['peak_rss_gb']:>9.2f}{r['peak_rss_gb'] / single3['peak_rss_gb']:>9.2f}"
        )
    for r, x0, x3 in zip(sharded, vs0, vs3):
        print(
            f"{'zero3 EP=2 rank ' + str(r['rank']):<24}{r['peak_rss_gb']:>12.2f}{r['bytes_read_gb']:>10.2f}"
            f"{x0:>9.2f}{x3:>9.2f}"
        )


if __name__ == "__main__":
    main()
