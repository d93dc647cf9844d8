"""Self-speculative decoding with the MTP block (model/speculative.py): accepted-draft rate and speed-up over
plain greedy decoding, on a tiny_ci model trained here with `model.mtp_depth=1`.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=2 .venv/bin/python -m bench.speculative               # 300 steps
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.speculative --steps 20 --prompts 2 --new 16

Training is the real trainer (1 process, ZeRO-0, the embedded corpus); then, per prompt (the first 16 tokens of a
held-out row of the same stream), `generate` (greedy, one main forward per token) and `generate_speculative` run
on the same model and must give the same tokens (checked). Acceptance = drafts the main model agreed with / drafts;
main forwards per new token (plain: 1); wall time ratio over all prompts (one process, timings include Python).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch

from bench.common import print_table, write_json
from model.generate import generate
from model.speculative import generate_speculative
from training.config import compose, validate
from training.trainer import Trainer


def train(steps: int, run_dir: str) -> Trainer:
    cfg = compose(
        [
            "experiment=tiny_ci",
            "model.mtp_depth=1",
            f"train.steps={steps}",
            "train.seq_len=128",
            "train.micro_batch_size=4",
            "deepspeed=zero0",
            "logging=disabled",
            "checkpoint.resume=none",
            f"run_dir={run_dir}",
        ]
    )
    trainer = Trainer(cfg, validate(cfg, 1))
    for _ in range(steps):
        last = trainer.train_step()
    print(f"trained {steps} steps: loss {last.loss:.3f} loss/mtp_1 {last.metrics.get('loss/mtp_1', float('nan')):.3f}")
    return trainer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="k3-bench-spec-") as run_dir:
        trainer = train(args.steps, run_dir)
        model = trainer.module.float().eval()
        rows_BT = trainer.loader.next_microbatch()["input_ids"]
        while rows_BT.shape[0] < args.prompts:
            rows_BT = torch.cat([rows_BT, trainer.loader.next_microbatch()["input_ids"]])
    drafted = accepted = forwards = new_tokens = 0
    t_plain = t_spec = 0.0
    for p in rows_BT[: args.prompts, :16]:
        t0 = time.perf_counter()
        plain = generate(model, p[None].long(), args.new)
        t1 = time.perf_counter()
        spec, st = generate_speculative(model, p[None].long(), args.new)
        t2 = time.perf_counter()
        if not torch.equal(plain, spec):
            raise SystemExit("speculative output differs from plain greedy decoding")
        t_plain, t_spec = t_plain + t1 - t0, t_spec + t2 - t1
        drafted, accepted, forwards = drafted + st.drafted, accepted + st.accepted, forwards + st.main_forwards
        new_tokens += spec.shape[1] - 16
    row = {
        "train_steps": args.steps,
        "prompts": args.prompts,
        "new_tokens": new_tokens,
        "acceptance": accepted / max(1, drafted),
        "main_forwards_per_token": (forwards + args.prompts) / max(1, new_tokens),  # + each prompt's prefill
        "plain_s": t_plain,
        "speculative_s": t_spec,
        "speed_up": t_plain / t_spec,
    }
    print_table("self-speculative greedy decoding, tiny_ci + 1 MTP block, batch 1, CPU fp32", [row])
    payload = {"rows": [row]}
    write_json("speculative", payload)
    return payload


if __name__ == "__main__":
    main()
