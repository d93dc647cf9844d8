"""Memory model check: measured peak memory of CPU train steps vs the planner's analytical estimate.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.memory                       # tiny 256..2048, small 1024
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.memory --cases tiny:512
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.memory --sp tiny:4096              # sequence parallelism

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

`--sp preset:seq_len` (issue 16): per-rank peak train-step memory with Ulysses sequence parallelism. One sequence of
seq_len tokens, ZeRO-0, fp32, under the real `deepspeed` launcher: 1 rank SP=1 and 2 ranks `parallel.sp_size=2`,
each built the trainer's way (training/parallel/construct.py, the engine with DeepSpeed's sequence-parallel mpu)
and running two train steps on its slice. Reported per rank: the peak heap minus the runtime heap (as above, from a
1-process child of the same case), the ratio SP=2 / SP=1 (goal <= 0.6) and each against `training.plan` with
`parallel.sp_size` (goal within 10%).
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


def sp_rank_child(preset: str, seq_len: int, sp: int, out: str) -> None:
    """One rank of the --sp case: the trainer's build, engine and step on this rank's slice of one sequence."""
    sys.path.insert(0, str(ROOT))  # run as a script by the launcher: bench/ is sys.path[0] and has its own data.py
    import torch

    from training.config import build_model_config, compose
    from training.distributed import init_distributed
    from training.engine import build_ds_config, initialize, param_groups
    from training.metrics.heap import HeapPeak
    from training.parallel.construct import build_model
    from training.step import pack_microbatch
    from training.tools.plan import Hardware, Layout, plan

    torch.set_num_threads(1)
    info = init_distributed()
    over = [f"model={preset}", "deepspeed=zero0", f"parallel.sp_size={sp}", f"train.seq_len={seq_len}"]
    cfg = compose([*over, "train.micro_batch_size=1", "train.precision=fp32", "logging=disabled"])
    mcfg = build_model_config(cfg)
    ds = build_ds_config(cfg, info.world_size)
    ids = torch.randint(0, mcfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    mb = pack_microbatch({"input_ids": ids, "labels": ids, "cu_seqlens": torch.tensor([0, seq_len])}, sp, info.rank)
    heap = HeapPeak()
    with heap:
        model, par = build_model(mcfg, 0, 1, 0, ds, sp_size=sp)
        engine, _, _ = initialize(cfg, model, ds, param_groups(model, 0.0), mpu=par.mpu)
        for _ in range(2):
            res = engine(**mb.model_inputs(engine.device))
            engine.backward(res.loss)
            engine.step()
            del res
    lay = Layout(zero_stage=0, sp_size=sp, micro_batch_size=1, seq_len=seq_len, precision="fp32")
    p = plan(mcfg, lay, Hardware(nodes=1, gpus_per_node=sp, reserve_gb=0.0, attention=ATTENTION))
    rec = {"peak_heap_GB": heap.peak / GB, "est_total_GB": p["gpu_memory_gb"]["total"], "est": p["gpu_memory_gb"]}
    Path(f"{out}.rank{info.rank}.json").write_text(json.dumps(rec))


def sp_case(case: str, env: dict[str, str], tmp: str) -> list[dict[str, Any]]:
    """Rows of one --sp case: 1 rank SP=1 and 2 ranks SP=2 through the launcher, per rank."""
    from training.launch import launch_command

    preset, _, seq = case.partition(":")
    runtime_heap = memory_child(preset, seq, env)["runtime_heap_GB"]
    rows: list[dict[str, Any]] = []
    for sp in (1, 2):
        out = os.path.join(tmp, f"{preset}_{seq}_sp{sp}")
        cmd = launch_command(["--sp-rank-child", preset, seq, str(sp), out], sp, __file__)
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"--sp {case} SP={sp} failed: {p.stderr.strip().splitlines()[-1:]}")
        for rank in range(sp):
            rec = json.loads(Path(f"{out}.rank{rank}.json").read_text())
            tensors = rec["peak_heap_GB"] - runtime_heap
            rows.append(
                {
                    "preset": preset,
                    "seq_len": int(seq),
                    "sp_size": sp,
                    "rank": rank,
                    "peak_heap_GB": rec["peak_heap_GB"],
                    "runtime_heap_GB": runtime_heap,
                    "peak_tensors_GB": tensors,
                    "est_total_GB": rec["est_total_GB"],
                    "plan_ratio": tensors / rec["est_total_GB"],
                    "est_terms_GB": rec["est"],
                }
            )
    base = rows[0]["peak_tensors_GB"]
    for r in rows:
        r["vs_sp1"] = r["peak_tensors_GB"] / base
    return rows


def memory_child(preset: str, seq: str, env: dict[str, str]) -> dict[str, float]:
    """One 1-process measurement (`child`) in a fresh process: its JSON record."""
    r = subprocess.run(
        [sys.executable, "-m", "bench.memory", "--child", preset, seq],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode != 0:
        raise SystemExit(f"memory child {preset}:{seq} failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def sp_main(cases: list[str], env: dict[str, str]) -> dict[str, Any]:
    import tempfile

    from bench.common import print_table, write_json

    env = dict(env, PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="k3-memsp-") as tmp:
        for case in cases:
            rows += sp_case(case, env, tmp)
    print_table(
        "per-rank train-step memory, Ulysses SP=2 vs SP=1 (ZeRO-0, fp32, one sequence; GB = 1e9 B; goals: vs_sp1 "
        "<= 0.6 on SP=2 ranks, plan_ratio 0.9..1.1)",
        rows,
        [
            "preset",
            "seq_len",
            "sp_size",
            "rank",
            "peak_heap_GB",
            "runtime_heap_GB",
            "peak_tensors_GB",
            "vs_sp1",
            "est_total_GB",
            "plan_ratio",
        ],
    )
    payload = {"rows": rows}
    print(f"wrote {write_json('memory_sp', payload)}")
    return payload


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="preset:seq_len items")
    ap.add_argument("--sp", nargs="+", metavar="PRESET:SEQ", help="sequence parallelism: SP=2 vs SP=1 per rank")
    ap.add_argument("--child", nargs=2, metavar=("PRESET", "SEQ"), help=argparse.SUPPRESS)
    ap.add_argument("--sp-rank-child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return {}
    if args.sp_rank_child:
        preset, seq, sp, out = args.sp_rank_child
        sp_rank_child(preset, int(seq), int(sp), out)
        return {}
    # fixed mmap threshold: glibc then returns every large block on free, so RSS tracks live tensors (its
    # default dynamic threshold keeps freed temporaries up to 32 MiB in the heap and RSS overstates the peak)
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"),
    )
    if args.sp:
        for case in args.sp:
            if not case.partition(":")[2].isdigit():
                raise SystemExit(f"--sp item {case!r} must be preset:seq_len, e.g. tiny:4096")
        return sp_main(args.sp, env)
    from bench.common import print_table, write_json

    rows = []
    for case in args.cases:
        preset, _, seq = case.partition(":")
        if not seq.isdigit():
            raise SystemExit(f"--cases item {case!r} must be preset:seq_len, e.g. tiny:1024")
        rows.append({"preset": preset, "seq_len": int(seq), **memory_child(preset, seq, env)})
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
    from training.distributed import leave

    sys.exit(leave(0))  # a rank ends without interpreter teardown (training/distributed.py)
