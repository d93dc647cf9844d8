"""Every rank runs the tiny K3 in float64 twice on one packed sequence: whole (the reference) and sequence-sharded
through training/parallel/ulysses.py (its T/N tokens, the head all-to-alls). Rank 0 writes the largest differences
(logits of each shard, loss, every parameter gradient summed over the ranks) to the JSON path given.

    deepspeed --no_local_rank --num_gpus 2 tests/distributed/sequence_shard_worker.py <out.json> <T> <doc lengths>
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from model import K3Config, K3ForCausalLM  # noqa: E402
from model.k3 import shift_targets  # noqa: E402
from training.parallel.ulysses import ulysses_shard  # noqa: E402


def main() -> None:
    out_path, T, lengths = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
    # as every entry point does (training/distributed.py): no JIT build of DeepSpeed's shm comm op (~40 s on CPU,
    # again after each switch of virtualenv: the build cache is shared), gloo alone
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    shard, _ = ulysses_shard(dist.get_world_size())
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    ref = K3ForCausalLM(cfg).double()
    sharded = copy.deepcopy(ref)
    sharded.set_sequence_shard(shard)
    if len(sys.argv) > 4:  # train.mixer_tile_tokens on the sharded side only (model/kda/tiled.py)
        sharded.set_mixer_tiling(int(sys.argv[4]))
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    assert int(cu[-1]) == T, f"doc lengths sum to {int(cu[-1])}, not T={T}"

    out = ref(ids, labels=ids, cu_seqlens=cu)
    (out.loss * out.num_loss_tokens).backward()  # the sum of CE: the sharded sums add up to it

    t = T // shard.size
    mine = slice(shard.rank * t, (shard.rank + 1) * t)
    targets = shift_targets(ids, cu)[:, mine]
    sout = sharded(ids[:, mine], cu_seqlens=cu, targets=targets)
    (sout.loss * sout.num_loss_tokens).backward()
    loss_sum = (sout.loss * sout.num_loss_tokens).detach().clone()
    dist.all_reduce(loss_sum)
    diffs = {
        "logits": float((sout.logits - out.logits[:, mine]).detach().abs().max()),
        "loss_sum": float((loss_sum - out.loss * out.num_loss_tokens).abs()),
    }
    grad_diff, grad_scale = 0.0, 0.0
    for p, q in zip(ref.parameters(), sharded.parameters()):
        g = q.grad if q.grad is not None else torch.zeros_like(q)
        dist.all_reduce(g)
        grad_diff = max(grad_diff, float((g - p.grad).abs().max()) if p.grad is not None else float(g.abs().max()))
        grad_scale = max(grad_scale, float(p.grad.abs().max()) if p.grad is not None else 0.0)
    diffs["grad"], diffs["grad_scale"] = grad_diff, grad_scale
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(diffs))


if __name__ == "__main__":
    main()
