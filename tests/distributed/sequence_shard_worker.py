"""Every rank runs the tiny K3 in float64 twice on one packed sequence: whole (the reference) and sequence-sharded
through training/parallel/ulysses.py (its T/N tokens, the head all-to-alls). Rank 0 writes the largest differences
(logits of each shard, loss, every parameter gradient summed over the ranks) to the JSON path given, one entry per
variant `D:W`: an MTP depth D (the model has D MTP blocks and the backward is the trainer's objective,
training/step.py `MicroBatch.objective`; "mtp" is then the largest difference of a depth's CE sum) and a KDA mixer
tile W on the sharded side (train.mixer_tile_tokens, model/kda/tiled.py; 0: untiled). The variants share one launch
(a launch costs ~10 CPU-s of start-up on the 2-core CI machine, the float64 model a fraction of that).

    deepspeed --no_local_rank --num_gpus 2 tests/distributed/sequence_shard_worker.py <out.json> <T> <doc lengths> \\
        <D:W>[,<D:W>...]
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
from training.step import pack_microbatch  # noqa: E402


def main() -> None:
    out_path, T, lengths = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
    # as every entry point does (training/distributed.py): no JIT build of DeepSpeed's shm comm op (~40 s on CPU,
    # again after each switch of virtualenv: the build cache is shared), gloo alone
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed("gloo")
    out = {v: seam_diffs(T, lengths, *(int(x) for x in v.split(":"))) for v in sys.argv[4].split(",")}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(out))


def seam_diffs(T: int, lengths: list[int], depth: int, mixer_tile: int) -> dict[str, float]:
    """The largest differences of the sharded model (MTP depth `depth`, mixer tile `mixer_tile`) from the whole."""
    shard, _ = ulysses_shard(dist.get_world_size())
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny", mtp_depth=depth)
    ref = K3ForCausalLM(cfg).double()
    sharded = copy.deepcopy(ref)
    sharded.set_sequence_shard(shard)
    sharded.set_mixer_tiling(mixer_tile)  # on the sharded side only
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    assert int(cu[-1]) == T, f"doc lengths sum to {int(cu[-1])}, not T={T}"

    out = ref(ids, labels=ids, cu_seqlens=cu)
    (out.loss * out.num_loss_tokens).backward()  # the sum of CE: the sharded sums add up to it

    t = T // shard.size
    mine = slice(shard.rank * t, (shard.rank + 1) * t)
    targets = shift_targets(ids, cu)[:, mine]
    sout = sharded(ids[:, mine], cu_seqlens=cu, targets=targets)
    if depth:  # the trainer's objective, scale 1
        mb = pack_microbatch({"input_ids": ids, "labels": ids, "cu_seqlens": cu}, shard.size, shard.rank, None, depth)
        assert torch.equal(mb.targets_1N, targets)
        mb.objective(sout, sharded.mtp_weight, 1.0).backward()
        loss_sum = ((sout.loss - sout.mtp_loss) * sout.num_loss_tokens).detach().clone()
        ref_sum = (out.loss - out.mtp_loss) * out.num_loss_tokens
    else:
        (sout.loss * sout.num_loss_tokens).backward()
        loss_sum, ref_sum = (sout.loss * sout.num_loss_tokens).detach().clone(), out.loss * out.num_loss_tokens
    dist.all_reduce(loss_sum)
    diffs = {
        "logits": float((sout.logits - out.logits[:, mine]).detach().abs().max()),
        "loss_sum": float((loss_sum - ref_sum).abs()),
    }
    for k in range(depth):  # per depth: the shards' CE sums and counts add up to the whole sequence's
        sums = torch.stack([sout.mtp_losses[k] * sout.mtp_counts[k], sout.mtp_counts[k].double()]).detach()
        dist.all_reduce(sums)
        want = torch.stack([out.mtp_losses[k] * out.mtp_counts[k], out.mtp_counts[k].double()]).detach()
        diffs["mtp"] = max(diffs.get("mtp", 0.0), float((sums - want).abs().max()))
    grad_diff, grad_scale = 0.0, 0.0
    for p, q in zip(ref.parameters(), sharded.parameters()):
        g = q.grad if q.grad is not None else torch.zeros_like(q)
        dist.all_reduce(g)
        grad_diff = max(grad_diff, float((g - p.grad).abs().max()) if p.grad is not None else float(g.abs().max()))
        grad_scale = max(grad_scale, float(p.grad.abs().max()) if p.grad is not None else 0.0)
    diffs["grad"], diffs["grad_scale"] = grad_diff, grad_scale
    return diffs


if __name__ == "__main__":
    main()
    from training.distributed import leave

    sys.exit(leave(0))  # a rank ends without interpreter teardown (training/distributed.py)
