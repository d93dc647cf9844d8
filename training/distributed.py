"""Process-group set-up for one process or the deepspeed launcher, and collectives the trainer needs.

A plain `python -m training.train` is a 1-rank gloo group (env defaults filled in here, otherwise DeepSpeed tries
MPI discovery). DeepSpeed's shared-memory comm op (inference all-reduce only) is skipped so nothing JIT-compiles.
`DistStatsReducer` is the balancer's StatsReducer over a torch.distributed group: sums all-reduce, concatenations
all-gather with variable lengths, so the router bias is a function of the global batch only.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from training.launch import free_port


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> DistInfo:
    """Rank info from the launcher's environment (or a 1-rank default), before any process group exists."""
    return DistInfo(
        int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    )


def init_distributed(timeout_s: float | None = None) -> DistInfo:
    """Initialise (once) the DeepSpeed/torch.distributed group; fills env defaults for a single process.
    `timeout_s` bounds the rendezvous and every collective (a peer lost mid-step: the rank raises, exits, and its
    launcher ends the job); None keeps DeepSpeed's default (30 min)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a ~37 s JIT build on CPU
    if not dist.is_initialized():
        kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        if timeout_s is not None:  # the groups DeepSpeed makes later (EP, expert-DP, SP: `new_group` without a
            # timeout) take torch's module default, not the world group's: set that default too
            c10d = dist.distributed_c10d
            c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = kw["timeout"]
        deepspeed.init_distributed(dist_init_required=True, verbose=False, **kw)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]))


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Out-of-place SUM over the group (identity when not distributed)."""
    out = t.clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class DistStatsReducer:
    """StatsReducer over a torch.distributed group: `sum` = all-reduce SUM, `cat` = variable-length all-gather.

    Ranks are concatenated in rank order, so the result is identical on every rank and, as the global batch is
    split into rank shares in row order, equals the single-rank concatenation of the same global batch.
    """

    def __init__(self, group=None) -> None:
        self.group = group

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, self.group)

    def cat(self, t: torch.Tensor) -> torch.Tensor:
        w = self._world()
        if w == 1:
            return t
        n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)
        sizes = [torch.zeros_like(n) for _ in range(w)]
        dist.all_gather(sizes, n, group=self.group)
        lens = [int(s.item()) for s in sizes]
        width = max(lens)
        padded = t.new_zeros((width, *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(w)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([p[:k] for p, k in zip(parts, lens)], dim=0)


_PEER_LOST = ("timed out", "connection closed", "connection reset", "broken pipe", "nccl error", "watchdog caught")


def peer_lost(e: BaseException) -> bool:
    """Whether `e` is a collective failing because a peer rank or node is gone (c10d's DistError, or gloo's and
    NCCL's RuntimeErrors: a timeout, a closed or reset connection)."""
    if isinstance(e, dist.DistError):
        return True
    msg = str(e).lower()
    from_backend = any(w in msg for w in ("gloo", "nccl", "c10d", "processgroup"))
    return isinstance(e, RuntimeError) and from_backend and any(w in msg for w in _PEER_LOST)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def leave(code: int) -> int:
    """End a process that joined a process group without the interpreter's teardown (`sys.exit(leave(main()))`).

    A gloo worker thread drops its last finished work just after the collective returns; if that is the last owner
    of a tensor Python also held, the drop takes the GIL, and during teardown that kills the rank with SIGABRT
    ("terminate called without an active exception", pytorch/pytorch#190489) after it did all its work: ~1
    launched export in 20 on a loaded 2-core machine. destroy_process_group does not prevent it here: DeepSpeed's
    groups and default arguments (`group=GroupMember.WORLD`, bound at import) keep the groups and their threads
    alive. So the exit handlers (W&B, logging) run while the interpreter is whole, stdio is flushed, and the
    process ends with `os._exit(code)`. A process without a group returns `code` and exits normally."""
    if not dist.is_initialized():
        return code
    atexit._run_exitfuncs()  # the handlers the interpreter would run first at exit (logging, W&B, multiprocessing)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
