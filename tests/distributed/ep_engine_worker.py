"""One rank of a DeepSpeed-engine expert-parallel job on a small LM built around the real LatentMoE.

Used by tests/distributed/test_expert_parallel_engine.py (launched with torchrun-style env vars, no Hydra):
    python ep_engine_worker.py <out_dir> <ep_size> <micro_rows> <grad_accum> <steps> [save|load:<ckpt_dir>]
Every rank builds the same model (seed 0) and the same global batches; rank r takes rows of its data-parallel
share. Writes <out_dir>/rank<r>.pt with per-step losses, router biases, global router counts and, for
`save`/`load`, logits on a fixed probe batch from the gathered full model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from model.config import K3Config  # noqa: E402
from model.moe.layer import LatentMoE  # noqa: E402
from model.norm import RMSNorm  # noqa: E402

V, T = 64, 16


class MoELM(nn.Module):
    """embed -> [norm -> LatentMoE] x 2 (residual) -> norm -> head; exposes moe_layers and router stats like K3."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(V, config.hidden_size)
        self.norms = nn.ModuleList(RMSNorm(config.hidden_size) for _ in range(2))
        # layer 0 balances with Quantile Balancing (bias), layer 1 with the sequence-wise auxiliary loss
        aux_cfg = config.replace(moe_balance="aux", moe_aux_loss_coef=0.1)
        self.moes = nn.ModuleList([LatentMoE(config, 0), LatentMoE(aux_cfg, 1)])
        self.head = nn.Linear(config.hidden_size, V, bias=False)

    def moe_layers(self) -> list[nn.Module]:
        return list(self.moes)

    def forward(self, ids_BT: torch.Tensor):
        h = self.embed(ids_BT)
        router_stats, aux = [], torch.zeros(())
        for norm, moe in zip(self.norms, self.moes):
            y, stats = moe(norm(h))
            h = h + y
            router_stats.append(stats)
            if stats.aux_loss is not None:
                aux = aux + stats.aux_loss
        return self.head(h), router_stats, aux


def config() -> K3Config:
    return K3Config.preset(
        "tiny",
        hidden_size=32,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=16,
        routed_expert_hidden_size=16,
        num_shared_experts=1,
        moe_balance="quantile",
    )


def main() -> None:
    out_dir = Path(sys.argv[1])
    ep_size, micro, ga, steps = (int(a) for a in sys.argv[2:6])
    mode = sys.argv[6] if len(sys.argv) > 6 else ""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True, warn_only=True)
    from training.balance import StepRouting, apply
    from training.parallelize import parallelize

    torch.manual_seed(0)
    model = MoELM(config())
    handle = parallelize(model, ep_size, zero_stage=2, expert_files=mode.startswith("load:") or ep_size > 1)
    groups = handle.param_groups(model, [{"params": list(model.parameters()), "weight_decay": 0.0}])
    opt = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    ds = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": ga,
        "train_batch_size": micro * ga * world,
        "gradient_clipping": float(os.environ.get("EP_TEST_CLIP", "0.05")),
        # buckets that still hold every gradient of this 22k-parameter model (one bucket, as with DeepSpeed's default
        # 5e8) without allocating 2 GB per bucket set-up: ~13 s of page faults per process saved
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1_000_000, "allgather_bucket_size": 1_000_000},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    reducer = handle.stats_reducer()
    if mode.startswith("load:"):
        _, client, same = handle.load_checkpoint(engine, mode[5:], "ckpt")
    gen = torch.Generator().manual_seed(7)
    global_rows = micro * ga * world
    losses, auxes, biases, counts = [], [], [], []
    for _ in range(steps):
        batch = torch.randint(0, V, (global_rows, T + 1), generator=gen)
        # rank r's rows of the global batch: consecutive share per rank, micro-batches in order
        mine = batch.view(world, ga, micro, T + 1)[rank]
        step_loss, step_aux = torch.zeros(()), torch.zeros(())
        routing = StepRouting()
        for m in range(ga):
            logits, router_stats, aux = engine(mine[m, :, :T])
            loss = nn.functional.cross_entropy(logits.reshape(-1, V), mine[m, :, 1:].reshape(-1)) + aux
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach() / ga
            step_aux += aux.detach() / ga
            routing.add(router_stats)
        dist.all_reduce(step_loss)
        dist.all_reduce(step_aux)
        losses.append(float(step_loss) / world)
        auxes.append(float(step_aux) / world)
        global_stats = routing.reduce_global(reducer)
        counts.append(torch.stack([g.counts_E for g in global_stats]))
        apply(engine.module.moe_layers(), global_stats)
        biases.append(torch.stack([m.gate.e_score_correction_bias.clone() for m in engine.module.moe_layers()]))
    result = {
        "losses": losses,
        "aux": auxes,
        "biases": torch.stack(biases) if biases else None,
        "counts": torch.stack(counts) if counts else None,
    }
    if mode.startswith("load:"):
        result["same_layout"] = same
    if mode == "save":
        engine.save_checkpoint(str(out_dir / "ckpt"), tag="ckpt", client_state=handle.client_state())
    probe = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(99))
    full = handle.full_model(engine.module).eval()
    with torch.no_grad():
        result["probe_logits"] = full(probe)[0]
    result["full_state"] = {k: v.clone() for k, v in handle.full_state_dict(engine.module).items()}
    torch.save(result, out_dir / f"rank{rank}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
    from training.distributed import leave

    sys.exit(leave(0))  # a rank ends without interpreter teardown (training/distributed.py)
