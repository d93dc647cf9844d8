"""KDA kernels, forward + backward: the chunked WY/UT path vs the per-token reference loop `naive_recurrent_kda`
(model/kda/naive.py; the "recurrent" peer, also the CPU decode path) and fla's pure-PyTorch `naive_chunk_kda` when
fla is installed, B = 1, H = 4, K = V = 64, T in {512, 2048, 8192}.

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.kda            # full run, writes bench/results/kda.json
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.kda --T 512 --reps 3
    DS_ACCELERATOR=cpu .venv/bin/python -m bench.kda --quick    # T = 2048, chunk 64, few reps -> kda_quick.json

Goal (issue 2 §6 / issue 7): chunked >= 50x faster than the recurrent loop at T = 2048. Chunk sizes 64 (the
default of docs/model.md §3 and fla), 32 and 16 are timed side by side: the result is identical, the cost is not
(on CPU the intra-chunk work grows with C while the sequential steps shrink). All peers are timed round-robin in
the same process so machine load affects them alike; medians and spread (max-min)/median are reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench.common import peak_matmul_flops, print_table, time_interleaved, write_json
from model.kda.naive import naive_recurrent_kda
from model.kda.ops import chunk_kda


def make_inputs(
    T: int, H: int = 4, K: int = 64, V: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[torch.Tensor]:
    """Inputs in the model's range: L2-normed q/k, g in (-5, 0) (the K3 bound), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen, dtype=dtype)
    g = -5.0 * torch.rand(1, T, H, K, generator=gen, dtype=dtype)
    beta = torch.rand(1, T, H, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def fwd_bwd(fn: Callable[..., Any], xs: list[torch.Tensor], **kw: Any) -> Callable[[], None]:
    def step() -> None:
        for x in xs:
            x.grad = None
        o, _ = fn(*xs, **kw)
        o.float().sum().backward()

    return step


def load_fla_naive(fla_path: str | None = None) -> Callable[..., Any] | None:
    """fla's `naive_chunk_kda`, loaded from its file (importing fla.ops needs Triton); None if fla is absent.

    `fla_path`: a directory holding an unpacked fla-core wheel (`fla/ops/kda/naive.py`, and einops if it is not
    installed), for a measurement without installing fla: it goes on sys.path for naive.py's own imports."""
    if fla_path is not None:
        sys.path.insert(0, fla_path)
        root = Path(fla_path) / "fla"
    else:
        spec = importlib.util.find_spec("fla")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = Path(list(spec.submodule_search_locations)[0])
    path = root / "ops" / "kda" / "naive.py"
    if not path.is_file():
        return None
    mod_spec = importlib.util.spec_from_file_location("_fla_kda_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - e.g. einops missing: the peer is optional
        return None
    return getattr(mod, "naive_chunk_kda", None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="K = V")
    ap.add_argument(
        "--chunk-sizes",
        type=int,
        nargs="+",
        default=[64, 32, 16],
        help="chunk sizes to time (the first is the headline; the result is the same for all)",
    )
    ap.add_argument("--reps", type=int, default=7, help="repetitions of the chunked path (median reported)")
    ap.add_argument("--loop-reps", type=int, default=3, help="repetitions of the recurrent loop (slow)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--out", default="kda", help="results name: bench/results/<out>.json")
    ap.add_argument(
        "--fla-path",
        default=None,
        help="directory with an unpacked fla-core wheel (fla/ops/kda/naive.py; einops beside it if it is "
        "not installed) to time fla's naive_chunk_kda without installing fla",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="T = 2048, chunk 64 only, 3 chunked reps and 1 loop rep, results name kda_quick",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.T, args.chunk_sizes, args.reps, args.loop_reps = [2048], [64], 3, 1
        args.out = "kda_quick" if args.out == "kda" else args.out
    if args.threads:
        torch.set_num_threads(args.threads)

    fla_naive = load_fla_naive(args.fla_path)
    peak = peak_matmul_flops()
    rows = []
    for T in args.T:
        xs = make_inputs(T, args.heads, args.dim, args.dim)
        peers: dict[str, Callable[[], None]] = {
            f"chunk{C}": fwd_bwd(chunk_kda, xs, chunk_size=C) for C in args.chunk_sizes
        }
        reps = dict.fromkeys(peers, args.reps)
        peers["recurrent"] = fwd_bwd(naive_recurrent_kda, xs)
        reps["recurrent"] = max(1, args.loop_reps if T <= 2048 else args.loop_reps // 2)
        if fla_naive is not None:
            peers["fla_naive"] = fwd_bwd(fla_naive, xs)
            reps["fla_naive"] = args.reps
        timings = time_interleaved(peers, reps=reps, warmup=1)
        row: dict[str, Any] = {"T": T}
        for name, t in timings.items():
            row[f"{name}_ms"] = t.median * 1e3
            row[f"{name}_spread"] = t.spread
        for C in args.chunk_sizes:
            row[f"loop/chunk{C}"] = timings["recurrent"].median / timings[f"chunk{C}"].median
            if "fla_naive" in timings:
                row[f"fla_naive/chunk{C}"] = timings["fla_naive"].median / timings[f"chunk{C}"].median
        row["raw"] = {name: t.as_dict() for name, t in timings.items()}
        rows.append(row)
        shown = {k: v for k, v in row.items() if k != "raw"}
        print_table(f"T={T}", [shown])

    cols = ["T", "recurrent_ms", "recurrent_spread"]
    for C in args.chunk_sizes:
        cols += [f"chunk{C}_ms", f"chunk{C}_spread", f"loop/chunk{C}"]
        if fla_naive is not None:
            cols += [f"fla_naive/chunk{C}"]
    if fla_naive is not None:
        cols += ["fla_naive_ms"]
    print_table(
        f"KDA fwd+bwd, B=1 H={args.heads} K=V={args.dim}, fp32, {torch.get_num_threads()} threads; "
        f"peak fp32 matmul {peak / 1e9:.1f} GFLOP/s"
        + ("" if fla_naive is not None else "; fla not installed: naive_chunk_kda peer skipped"),
        rows,
        cols,
    )
    payload = {"config": vars(args), "peak_matmul_flops": peak, "fla_naive": fla_naive is not None, "rows": rows}
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
