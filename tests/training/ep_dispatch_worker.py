"""One rank of the 2-process all-to-all dispatcher check (run by tests/training/test_alltoall_dispatch.py).

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python ep_dispatch_worker.py <out_dir>
Every rank builds the same global batch and full experts (seeded), keeps its consecutive share of the tokens and
its E/2 experts, runs AllToAllDispatcher forward+backward and compares with LocalDispatcher on the whole batch.
Writes <out_dir>/rank<r>.pt: {case: {"out": err, "grad_z": err, "grad_w": err, "grad_experts": err, ...}}.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.probes import count_syncs  # noqa: E402
from model.config import K3Config  # noqa: E402
from model.moe.dispatch import LocalDispatcher  # noqa: E402
from model.moe.experts import LatentExperts  # noqa: E402
from training.parallel.alltoall import AllToAllDispatcher  # noqa: E402

E, K, L = 8, 3, 16


def routing(kind: str, N: int, gen: torch.Generator) -> torch.Tensor:
    """[N, K] distinct expert ids per token for a routing pattern."""
    scores = torch.rand(N, E, generator=gen, dtype=torch.float64)
    if kind == "skewed":  # most tokens pick expert 0 (on rank 0) first
        scores[:, 0] += (torch.rand(N, generator=gen, dtype=torch.float64) < 0.9).double() * 10
    elif kind == "empty":  # experts 4..7 (all of rank 1) receive nothing
        scores[:, 4:] -= 10
    elif kind == "one_expert_per_rank_empty":  # expert 1 and 6 never selected
        scores[:, [1, 6]] -= 10
    return scores.topk(K, dim=-1).indices


def run_case(kind: str, dtype: torch.dtype, shares: list[int], backend: str = "loop", *, rank: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1234)
    cfg = K3Config.preset(
        "tiny", num_experts=E, num_experts_per_token=K, routed_expert_hidden_size=L, moe_intermediate_size=24
    )
    torch.manual_seed(0)
    full = LatentExperts(cfg).to(dtype)
    N = sum(shares)
    z_NL = torch.randn(N, L, generator=gen, dtype=torch.float64).to(dtype)
    idx_NK = routing(kind, N, gen)
    w_NK = torch.rand(N, K, generator=gen, dtype=torch.float64).to(dtype)
    g_NL = torch.randn(N, L, generator=gen, dtype=torch.float64).to(dtype)

    # reference: all tokens, all experts, one process
    z_ref, w_ref = z_NL.clone().requires_grad_(), w_NK.clone().requires_grad_()
    u_ref = LocalDispatcher()(z_ref, idx_NK, w_ref, full)
    (u_ref * g_NL).sum().backward()

    # this rank: its consecutive share of tokens, its E/2 experts
    El = E // 2
    lo = sum(shares[:rank])
    sl = slice(lo, lo + shares[rank])
    local = LatentExperts(cfg, num_local=El, expert_offset=rank * El).to(dtype)
    with torch.no_grad():
        for w in ("w1", "w3", "w2"):
            getattr(local, w).copy_(getattr(full, w)[rank * El : (rank + 1) * El])
    z, w = z_NL[sl].clone().requires_grad_(), w_NK[sl].clone().requires_grad_()
    disp = AllToAllDispatcher(E)
    disp.backend = backend  # model.expert_backend; the reference stays the local loop backend
    with count_syncs() as syncs:
        u = disp(z, idx_NK[sl], w, local)
        (u * g_NL[sl]).sum().backward()

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0

    out = {
        "out": err(u, u_ref[sl]),
        "grad_z": err(z.grad, z_ref.grad[sl]),
        "grad_w": err(w.grad, w_ref.grad[sl]),
        "bytes_sent": float(disp.bytes_sent),
        "rows": float(shares[rank] * K),
        "syncs": dict(syncs.counts),
    }
    out["grad_experts"] = max(
        err(getattr(local, n).grad, getattr(full, n).grad[rank * El : (rank + 1) * El]) for n in ("w1", "w3", "w2")
    )
    out["bitwise_forward"] = float(torch.equal(u, u_ref[sl]))
    experts_equal = all(
        torch.equal(getattr(local, n).grad, getattr(full, n).grad[rank * El : (rank + 1) * El])
        for n in ("w1", "w3", "w2")
    )
    out["bitwise_backward"] = float(
        torch.equal(z.grad, z_ref.grad[sl]) and torch.equal(w.grad, w_ref.grad[sl]) and experts_equal
    )
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True, warn_only=True)
    cases = {
        "random_fp64": ("random", torch.float64, [37, 20]),
        "skewed_fp64": ("skewed", torch.float64, [29, 30]),
        "empty_rank_fp64": ("empty", torch.float64, [17, 8]),
        "empty_experts_fp64": ("one_expert_per_rank_empty", torch.float64, [13, 19]),
        "no_tokens_on_rank1_fp64": ("random", torch.float64, [21, 0]),
        "random_fp32": ("random", torch.float32, [33, 33]),
        # the grouped_mm expert backend (model/moe/grouped.py) on the expert ranks
        "random_fp64_grouped": ("random", torch.float64, [37, 20], "grouped_mm"),
        "empty_rank_fp64_grouped": ("empty", torch.float64, [17, 8], "grouped_mm"),
        "no_tokens_on_rank1_fp64_grouped": ("random", torch.float64, [21, 0], "grouped_mm"),
        "random_fp32_grouped": ("random", torch.float32, [33, 33], "grouped_mm"),
    }
    results = {name: run_case(*spec, rank=rank) for name, spec in cases.items()}
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
