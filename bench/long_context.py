"""Long-sequence memory on CPU: what tiling saves per rank (issue 24).

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.long_context                      # parts at 16k and 32k tokens
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.long_context --seqs --steps 16384  # whole train steps (minutes)

Each case runs in a fresh child process with glibc's mmap threshold fixed (so freed tensors leave the heap at once)
and reports the peak heap growth over forward + backward (training/metrics/heap.py, the CPU analogue of
`torch.cuda.max_memory_allocated`), the inputs and weights excluded, untiled vs tiled, measured in the same run:
  * loss: lm_head + cross-entropy of T hidden states of the `tiny` preset (d 256, vocab 4096): the full [T, V]
    logits + the chunked CE (`train.loss_tile_tokens=0`) vs `TiledLinearCrossEntropy` with tiles of 1024 tokens;
  * ffn: one dense SiTU-GLU (d 256, intermediate 1024): untiled vs `train.ffn_tile_tokens=1024`;
  * step (`--steps`): one `tiny` train step (forward + backward, activation checkpointing on) of one sequence,
    without and with both tilings: the per-rank peak at SP=1.
Losses and gradients are compared in the same run (max relative difference, tiled vs untiled).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
TILE = 1024


def _peak(fn) -> tuple[float, Any]:
    from training.metrics.heap import HeapPeak

    heap = HeapPeak()
    with heap:
        out = fn()
    return heap.peak / GB, out


def child(part: str, seq: int, tiled: bool) -> dict[str, Any]:
    import torch

    from model import K3Config, K3ForCausalLM
    from model.ffn import SiTUGLU
    from model.k3 import causal_lm_loss
    from model.loss import LMHead

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    g = torch.Generator().manual_seed(1)
    if part == "loss":
        head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        head.tile_rows = TILE if tiled else 0
        h = torch.randn(1, seq, cfg.hidden_size, generator=g).requires_grad_()
        t = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)

        def run():
            if tiled:
                loss = head(h, t) / seq
            else:
                loss, _ = causal_lm_loss(head(h), None, None, t)
            loss.backward()
            return float(loss.detach())

        peak, loss = _peak(run)
        grads = [h.grad, head.weight.grad]
    elif part == "ffn":
        ffn = SiTUGLU(cfg.hidden_size, cfg.intermediate_size, cfg).train()
        ffn.tile_rows = TILE if tiled else 0
        x = torch.randn(1, seq, cfg.hidden_size, generator=g).requires_grad_()

        def run():
            y = ffn(x)
            y.backward(torch.ones_like(y))
            return float(y.detach().double().sum())

        peak, loss = _peak(run)
        grads = [x.grad, *(p.grad for p in ffn.parameters())]
    else:
        model = K3ForCausalLM(cfg).train()
        model.set_gradient_checkpointing(True)
        model.set_loss_tiling(TILE if tiled else 0)
        model.set_ffn_tiling(TILE if tiled else 0)
        ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)

        def run():
            out = model(ids, labels=ids)
            out.loss.backward()
            return float(out.loss.detach())

        peak, loss = _peak(run)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
    path = os.environ["K3_LONG_CONTEXT_GRADS"]
    torch.save([gr.detach() for gr in grads], f"{path}.{int(tiled)}.pt")
    return {"peak_GB": peak, "loss": loss}


def _case(part: str, seq: int, env: dict[str, str], tmp: str) -> dict[str, Any]:
    import torch

    env = dict(env, K3_LONG_CONTEXT_GRADS=f"{tmp}/{part}{seq}")
    res = []
    for tiled in (False, True):
        cmd = [sys.executable, "-m", "bench.long_context", "--child", part, str(seq), str(int(tiled))]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        res.append(json.loads(p.stdout.strip().splitlines()[-1]))
    g0, g1 = (torch.load(f"{tmp}/{part}{seq}.{i}.pt") for i in (0, 1))
    grad_diff = max(float((a - b).abs().max()) / max(float(a.abs().max()), 1e-30) for a, b in zip(g0, g1))
    return {
        "part": part,
        "seq_len": seq,
        "untiled_GB": res[0]["peak_GB"],
        "tiled_GB": res[1]["peak_GB"],
        "ratio": res[1]["peak_GB"] / res[0]["peak_GB"],
        "loss_rel_diff": abs(res[1]["loss"] - res[0]["loss"]) / abs(res[0]["loss"]),
        "grad_rel_diff": grad_diff,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", nargs="*", type=int, default=[16384, 32768], help="tokens of the loss/ffn parts")
    ap.add_argument("--steps", nargs="*", type=int, default=[], help="tokens of whole train steps (slow)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        part, seq, tiled = args.child
        print(json.dumps(child(part, int(seq), bool(int(tiled)))))
        return {}
    import tempfile

    from bench.common import print_table, write_json

    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(p, s) for s in args.seqs for p in ("loss", "ffn")] + [("step", s) for s in args.steps]
        for part, seq in cases:
            rows.append(_case(part, seq, env, tmp))
            print(rows[-1], flush=True)
    print_table(
        f"peak memory over forward + backward, untiled vs tiled ({TILE}-token tiles), tiny, 1 process, fp32",
        rows,
        ["part", "seq_len", "untiled_GB", "tiled_GB", "ratio", "loss_rel_diff", "grad_rel_diff"],
    )
    payload = {"tile_tokens": TILE, "rows": rows}
    print(f"wrote {write_json('long_context', payload)}")
    return payload


if __name__ == "__main__":
    main()
