"""Carry a ZeRO-1/2 checkpoint's optimizer to another world size or EP size: fp32 master weights, Adam moments and
step counts, re-partitioned for this run's layout, experts matched by global id.

DeepSpeed cannot do it here: its ZeRO-1/2 load refuses a new data-parallel size with optimizer states (engine
`_load_zero_checkpoint`: "Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not
currently supported"), and `ds_to_universal` refuses expert-parallel ZeRO-1/2 checkpoints (no
`universal_checkpoint_info`; its merge would also join the different experts EP ranks hold under one local name).
So this reads DeepSpeed's own shards at resume time: no format of our own, nothing extra at save time, and every
ZeRO-1/2 checkpoint already written can be carried.

DeepSpeed contracts relied on (0.19.8; the reading side is what `ds_to_universal`'s `extract_zero_shards` reads):
  * rank r writes `zero_pp_rank_{r}_mp_rank_00_optim_states.pt`; its `optimizer_state_dict`
    (stage_1_and_2 `state_dict`) holds, per optimizer param group g (one flat fp32 partition each):
    `param_slice_mappings[g]` (param name -> `fragment_address(numel, start)` in that partition),
    `single_partition_of_fp32_groups[g]` (the fp32 partition, trailing padding stripped) and
    `base_optimizer_state` (the torch optimizer's `state_dict()`, state keyed g; with `elastic_checkpoint` a list
    of per-group state dicts);
  * a param is contiguous in its group's flat buffer, so its fragments in the order of the group's data-parallel
    ranks concatenate to the param flattened;
  * groups (`utils/groups._create_expert_and_data_parallel`, E + D topology, no model parallelism): dense groups
    are partitioned over all ranks in rank order, expert groups of EP rank e = r % P over the expert-data-parallel
    ranks [e, e + P, e + 2P, ...]; EP rank e holds the global experts [e*E/P, (e+1)*E/P) (training/parallelize.py);
  * on load, each param's `_hp_mapping` (utils/tensor_fragment: `lp_fragment_address` into the flattened param,
    `hp_fragment` a view of this rank's fp32 partition) says which slice this rank owns, as
    `safe_set_full_fp32_param` uses it; the moments go into the torch optimizer's `state[flat partition]`, which
    the fragments link to lazily at the next step (`_lazy_init_hp_params_optimizer_state`).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from training.checkpoint.safe_load import CheckpointError, safe_torch_load

OPTIM_FILE = "zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
_OPTIM_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
FP32 = "fp32"  # the master weights, next to the optimizer's own state keys (exp_avg, exp_avg_sq)


def optim_files(tag_dir: str) -> list[str]:
    """The ZeRO-1/2 optimizer shard of every rank, rank order ([] for a ZeRO-0 or ZeRO-3 checkpoint)."""
    found = {}
    for path in glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_00_optim_states.pt")):
        m = _OPTIM_RE.search(path)
        if m:
            found[int(m.group(1))] = path
    if sorted(found) != list(range(len(found))):
        raise CheckpointError(
            f"{tag_dir} holds optimizer shards of ranks {sorted(found)}, not 0..{len(found) - 1}: incomplete; "
            "resume from another checkpoint"
        )
    return [found[r] for r in range(len(found))]


def checkpoint_zero_stage(tag_dir: str) -> int | None:
    """1 or 2 for a ZeRO-1/2 checkpoint (from its rank-0 optimizer shard), None when it has no such shards."""
    files = optim_files(tag_dir)
    if not files:
        return None
    return int(safe_torch_load(files[0], mmap=True)["optimizer_state_dict"]["zero_stage"])


class SavedZeroState:
    """Layout-free view of a ZeRO-1/2 checkpoint's optimizer: `full(name, key)` is the whole param's fp32 master
    (`FP32`) or optimizer state (`exp_avg`, ...), experts stacked by global id, whatever layout wrote it.
    Shards are memory-mapped, so only what is asked for is read."""

    def __init__(self, tag_dir: str, ep_size: int, expert_names: Sequence[str]) -> None:
        files = optim_files(tag_dir)
        if not files:
            raise CheckpointError(f"{tag_dir} holds no ZeRO-1/2 optimizer shards")
        self.tag_dir, self.world, self.ep_size = tag_dir, len(files), int(ep_size)
        if self.world % self.ep_size:
            raise CheckpointError(f"{tag_dir}: {self.world} optimizer shards cannot come from EP size {ep_size}")
        self.expert_names = set(expert_names)
        self.sds = [safe_torch_load(f, mmap=True)["optimizer_state_dict"] for f in files]
        self._where: dict[str, list[tuple[int, int, Any]]] = {}  # name -> [(rank, group, fragment address)]
        for r, sd in enumerate(self.sds):
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                for name, addr in mapping.items():
                    self._where.setdefault(name, []).append((r, g, addr))
        first = self._group_state(0, 0)
        self.moment_keys = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() == 1)
        self.scalars = {k: v for k, v in first.items() if k not in self.moment_keys}
        for r, sd in enumerate(self.sds):  # ZeRO steps every group together: one step count for all
            for g in range(len(sd["param_slice_mappings"])):
                other = self._group_state(r, g)
                if sorted(other) != sorted(first) or any(_differs(other[k], v) for k, v in self.scalars.items()):
                    raise CheckpointError(
                        f"{files[r]}: optimizer group {g} has state {sorted(other)} / step unlike group 0's; "
                        "resume it at the layout that wrote it"
                    )

    def names(self) -> set[str]:
        return set(self._where)

    def _group_state(self, r: int, g: int) -> dict[str, Any]:
        base = self.sds[r]["base_optimizer_state"]
        states = base["state"] if isinstance(base, dict) else base  # rigid: torch state_dict; elastic: a list
        try:
            return states[g]
        except (KeyError, IndexError):
            raise CheckpointError(
                f"{self.tag_dir}: rank {r} has no optimizer state for group {g} (saved before the first step?); "
                "resume it at the layout that wrote it"
            ) from None

    def _partition(self, r: int, g: int, key: str) -> torch.Tensor:
        if key == FP32:
            return self.sds[r]["single_partition_of_fp32_groups"][g]
        return self._group_state(r, g)[key]

    def _flat(self, name: str, key: str, ranks: Sequence[int]) -> torch.Tensor:
        parts = [self._partition(r, g, key).narrow(0, a.start, a.numel) for r, g, a in self._where[name] if r in ranks]
        return torch.cat(parts) if parts else torch.empty(0)

    def full(self, name: str, key: str, rest: Sequence[int]) -> torch.Tensor:
        """The whole param `name`: [E, *rest] for an expert param (rows = global expert ids), else flat."""
        if name not in self._where:
            raise CheckpointError(f"{self.tag_dir} has no optimizer state for {name}; resume it at its own layout")
        if name not in self.expert_names or self.ep_size == 1:
            out = self._flat(name, key, range(self.world))
            return out.view(-1, *rest) if name in self.expert_names else out
        # EP rank e's local experts, from its expert-data-parallel ranks e, e + P, ...; then e = 0, 1, ... in order
        per_rank = [self._flat(name, key, range(e, self.world, self.ep_size)) for e in range(self.ep_size)]
        return torch.cat([t.view(-1, *rest) for t in per_rank])


def _differs(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a != b


@torch.no_grad()
def restore_optimizer(engine, saved: SavedZeroState, expert_rows: dict[str, slice]) -> int:
    """Collective. Fill this rank's ZeRO-1/2 partitions (fp32 masters, optimizer state) from `saved`, then refresh
    the model's weights from the masters. `expert_rows`: name -> the global experts this rank holds (its rows of
    the [E, ...] tensor). Returns the number of params restored."""
    opt = engine.optimizer
    inner, names = opt.optimizer, opt.param_names
    done = 0
    for g, group in enumerate(inner.param_groups):
        flat_hp = opt.single_partition_of_fp32_groups[g]
        bufs = {k: torch.zeros_like(flat_hp) for k in saved.moment_keys}
        for lp in opt.bit16_groups[g]:
            m = lp._hp_mapping
            if m is None:  # no slice of this param in this rank's partition
                continue
            name = names[lp]
            for key in (FP32, *saved.moment_keys):
                full = saved.full(name, key, lp.shape[1:])
                local = full[expert_rows[name]] if name in expert_rows else full
                if local.numel() != lp.numel():
                    raise CheckpointError(
                        f"{saved.tag_dir}: {name} has {local.numel()} saved elements for this rank, the model "
                        f"{lp.numel()}; resume it with the model that wrote it"
                    )
                src = local.reshape(-1).narrow(0, m.lp_fragment_address.start, m.lp_fragment_address.numel)
                if key == FP32:
                    m.hp_fragment.copy_(src)
                else:
                    a = m.hp_fragment_address
                    bufs[key].narrow(0, a.start, a.numel).copy_(src)
            done += 1
        inner.state[group["params"][0]] = {
            **{k: v.clone() if torch.is_tensor(v) else v for k, v in saved.scalars.items()},
            **bufs,
        }
    opt._hp_optimizer_states_linked = False  # fragments re-link to these state tensors at the next step
    opt.update_lp_params()  # model weights from the restored fp32 masters (all-gather over each group)
    return done
