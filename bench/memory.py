"""Memory model check: measured peak memory of CPU train steps vs the planner's analytical estimate.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.memory                       # tiny 256..2048, small 1024
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.memory --cases tiny:512

Each case runs in a fresh child process: imports, the baseline, then model + AdamW, two train steps (fwd + CE +
bwd + AdamW; the first allocates the optimizer state). Comparisons, each a ratio measured / estimated (goal: within
10%):
- activations: bytes autograd saves for backward in one forward (saved_tensors_hooks, each storage counted once)
  vs `training.tools.activation_memory.activation_bytes` (fp32, attention='flash': see ATTENTION);
- peak (the goal): the peak of tensor bytes over the steps vs `training.tools.plan.plan`'s total for the same layout
  (1 process, ZeRO-0, fp32, no buffers/reserve): weights + AdamW state + max(activations + loss backward, grads).
  Tensor bytes = glibc's in-use heap (`mallinfo2`, sampled every 0.2 ms by a thread; with a fixed 128 KiB mmap
  threshold every tensor above it is its own mapping: the CPU analogue of `torch.cuda.max_memory_allocated`)
  minus the heap that is not tensors (`runtime_heap`: BLAS/oneDNN workspaces and autograd bookkeeping, measured
  after the steps as the heap left besides weights and AdamW state);
- rss: peak RSS minus the pre-model baseline and the process's runtime growth (`runtime`: that heap plus library
  pages mapped lazily by the first kernels; on a GPU the planner's `reserve` covers the like), for completeness.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CASES = ("tiny:256", "tiny:1024", "tiny:2048", "small:1024")
GB = 1e9
# MLA runs PyTorch's CPU flash kernel (model/mla.py pads v to the q/k head dim for it, one call per packed
# document): it keeps the log-sum-exp, not the T x T probabilities, so the planner's "flash" attention term applies
ATTENTION = "flash"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(preset: str, seq_len: int) -> dict[str, float]:
    import torch

    from model import K3Config, K3ForCausalLM
    from training.metrics.heap import HeapPeak
    from training.tools.activation_memory import activation_bytes
    from training.tools.plan import Hardware, Layout, plan

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = K3Config.preset(preset)
    ids_BT = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    base = _rss_bytes()
    heap = HeapPeak()
    torch.manual_seed(0)
    with heap:
        model = K3ForCausalLM(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        n_params = sum(p.numel() for p in model.parameters())

        # saved activations of one forward, each storage once (views of one tensor share it)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu" and not isinstance(t, torch.nn.Parameter):
                st = t.untyped_storage()
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            return t

        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for step in range(2):
            if step == 0:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(ids_BT, labels=ids_BT)
                after_fwd = _rss_bytes() - base  # weights + saved activations (+ allocator slack), before backward
            else:
                out = model(ids_BT, labels=ids_BT)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            for moe, stats in zip(model.moe_layers(), out.router_stats):  # the trainer's bias update
                moe.balancer.update(stats.balance)
            del out
        heap_end = heap.now()
        # heap that is not tensors: what remains after the steps besides weights + AdamW's m, v (grads are freed)
        # is BLAS / oneDNN workspace and autograd bookkeeping, a constant of the process like the CUDA context
        runtime_heap = heap_end - 3 * 4 * n_params
        runtime = (_rss_bytes() - base) - heap_end  # non-heap RSS growth: lazily mapped libraries
    saved = sum(b for ptr, b in seen.items() if ptr not in params)
    peak_rss = _peak_rss_bytes() - base
    est_act = activation_bytes(cfg, 1, seq_len, 4, False, ATTENTION)["total"]
    p = plan(
        cfg,
        Layout(zero_stage=0, micro_batch_size=1, seq_len=seq_len, precision="fp32", reduce_bucket_size=0),
        Hardware(nodes=1, gpus_per_node=1, reserve_gb=0.0, attention=ATTENTION),
    )
    est_total = p["gpu_memory_gb"]["total"] * GB
    return {
        "params_M": n_params / 1e6,
        "static_GB": n_params * 16 / GB,
        "saved_act_GB": saved / GB,
        "est_act_GB": est_act / GB,
        "act_ratio": saved / est_act,
        "fwd_end_GB": after_fwd / GB,
        "peak_heap_GB": heap.peak / GB,
        "runtime_heap_GB": runtime_heap / GB,
        "peak_tensors_GB": (heap.peak - runtime_heap) / GB,
        "est_total_GB": est_total / GB,
        "peak_ratio": (heap.peak - runtime_heap) / est_total,
        "peak_rss_GB": peak_rss / GB,
        "runtime_GB": (runtime + runtime_heap) / GB,
        "rss_ratio": (peak_rss - runtime - runtime_heap) / est_total,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="preset:seq_len items")
    ap.add_argument("--child", nargs=2, metavar=("PRESET", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return {}
    from bench.common import print_table, write_json

    rows = []
    # fixed mmap threshold: glibc then returns every large block on free, so RSS tracks live tensors (its
    # default dynamic threshold keeps freed temporaries up to 32 MiB in the heap and RSS overstates the peak)
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"),
    )
    for case in args.cases:
        preset, _, seq = case.partition(":")
        if not seq.isdigit():
            raise SystemExit(f"--cases item {case!r} must be preset:seq_len, e.g. tiny:1024")
        r = subprocess.run(
            [sys.executable, "-m", "bench.memory", "--child", preset, seq],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if r.returncode != 0:
            raise SystemExit(f"memory child {case} failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
        rows.append({"preset": preset, "seq_len": int(seq), **json.loads(r.stdout.strip().splitlines()[-1])})
        print(f"{case}: {rows[-1]}", flush=True)
    print_table(
        "train-step memory, measured vs planner (fp32, batch 1, 1 process; GB = 1e9 B; goal ratio 0.9..1.1)",
        rows,
        [
            "preset",
            "seq_len",
            "params_M",
            "static_GB",
            "saved_act_GB",
            "est_act_GB",
            "act_ratio",
            "peak_heap_GB",
            "runtime_heap_GB",
            "peak_tensors_GB",
            "est_total_GB",
            "peak_ratio",
            "peak_rss_GB",
            "runtime_GB",
            "rss_ratio",
        ],
    )
    payload = {"rows": rows}
    print(f"wrote {write_json('memory', payload)}")
    return payload


if __name__ == "__main__":
    main()
