"""Expert-parallel LatentMoE on 2 CPU ranks: all-to-all path vs local path, and bytes sent per token.

Each of 2 gloo ranks holds `tokens` tokens. Peers, timed round-robin in the same run (bench/common.py):
  local  every rank holds all E experts (pure data parallelism, LocalDispatcher), no token exchange;
  a2a    every rank holds E/2 experts and exchanges latent rows with AllToAllDispatcher (training/ep).
Time per step = one LatentMoE forward + backward. Bytes per token: what the all-to-all actually ships (latent
width l, there and back) vs the same exchange in the hidden width d (what a dispatcher before the d->l projection
would ship), plus the measured time of an exchange round trip at either width.

Run: `python -m bench.moe_ep` (tokens 2048/rank, d 256, l 128, E {8, 64}, k {2, 8}) or `--quick`.
Writes bench/results/moe_ep.json (moe_ep_quick.json for --quick). Spawns its own 2 ranks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist


def _configs(quick: bool) -> list[dict]:
    if quick:
        return [dict(tokens=512, E=8, k=2)]
    return [dict(tokens=2048, E=E, k=k) for E in (8, 64) for k in (2, 8)]


def _bench_rank(quick: bool, reps: int) -> list[dict]:
    from bench.common import time_interleaved
    from model.config import K3Config
    from model.moe.layer import LatentMoE
    from training.parallel.alltoall import AllToAllDispatcher, _a2a

    rank, world = dist.get_rank(), dist.get_world_size()
    d, l = 256, 128
    rows = []
    for c in _configs(quick):
        cfg = K3Config.preset(
            "tiny",
            hidden_size=d,
            routed_expert_hidden_size=l,
            moe_intermediate_size=128,
            num_experts=c["E"],
            num_experts_per_token=c["k"],
            moe_balance="none",
        )
        torch.manual_seed(0)
        local = LatentMoE(cfg, 1)
        torch.manual_seed(0)
        ep = LatentMoE(cfg, 1)
        El = c["E"] // world
        with torch.no_grad():
            for w in ("w1", "w3", "w2"):
                p = getattr(ep.experts, w)
                p.data = p.data[rank * El : (rank + 1) * El].clone()
        ep.experts.num_local, ep.experts.expert_offset = El, rank * El
        ep.dispatcher = AllToAllDispatcher(c["E"])
        x = torch.randn(1, c["tokens"], d, generator=torch.Generator().manual_seed(rank))

        def step(layer):
            def run():
                layer.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_()
                y, _ = layer(xi)
                y.square().mean().backward()

            return run

        M = c["tokens"] * c["k"]
        lat, hid = torch.randn(M, l), torch.randn(M, d)
        splits = [M // world] * world
        splits[-1] += M - sum(splits)

        def exchange(t):
            return lambda: _a2a(_a2a(t, splits, splits, None), splits, splits, None)

        dist.barrier()
        t = time_interleaved(
            {"local": step(local), "a2a": step(ep), "xchg_l": exchange(lat), "xchg_d": exchange(hid)},
            reps=reps,
            warmup=1,
        )
        sent = torch.tensor([float(ep.dispatcher.bytes_sent)])
        dist.all_reduce(sent)
        med = torch.tensor([t["local"].median, t["a2a"].median, t["xchg_l"].median, t["xchg_d"].median])
        dist.all_reduce(med, op=dist.ReduceOp.MAX)  # a step is as slow as the slowest rank
        bytes_per_token = float(sent) / (world * c["tokens"])
        rows.append(
            dict(
                tokens_per_rank=c["tokens"],
                E=c["E"],
                k=c["k"],
                d=d,
                l=l,
                local_ms=1e3 * float(med[0]),
                a2a_ms=1e3 * float(med[1]),
                a2a_over_local=float(med[1] / med[0]),
                bytes_per_token_latent=bytes_per_token,
                bytes_per_token_hidden=bytes_per_token * d / l,
                xchg_latent_ms=1e3 * float(med[2]),
                xchg_hidden_ms=1e3 * float(med[3]),
                spread_a2a=t["a2a"].spread,
                spread_local=t["local"].spread,
            )
        )
    return rows


def _worker(quick: bool, reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = _bench_rank(quick, reps)
    if dist.get_rank() == 0:
        from bench.common import print_table, write_json

        print_table(
            "LatentMoE fwd+bwd per step on 2 CPU ranks: all-to-all EP vs local (DP)",
            rows,
            [
                "tokens_per_rank",
                "E",
                "k",
                "local_ms",
                "a2a_ms",
                "a2a_over_local",
                "bytes_per_token_latent",
                "bytes_per_token_hidden",
                "xchg_latent_ms",
                "xchg_hidden_ms",
            ],
        )
        path = write_json("moe_ep_quick" if quick else "moe_ep", {"world": dist.get_world_size(), "rows": rows})
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small config, 3 reps")
    ap.add_argument("--reps", type=int, default=None)
    a = ap.parse_args(argv)
    reps = a.reps or (3 if a.quick else 5)
    if "RANK" in os.environ:
        _worker(a.quick, reps)
        return
    from training.launch import free_port

    port = str(free_port())
    root = Path(__file__).resolve().parents[1]
    procs = []
    for r in range(2):
        env = dict(
            os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1"
        )
        args = [sys.executable, "-m", "bench.moe_ep", *(["--quick"] if a.quick else []), "--reps", str(reps)]
        procs.append(subprocess.Popen(args, env=env, cwd=root))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a benchmark rank failed (exit codes {codes})")


if __name__ == "__main__":
    main()
