"""One evaluation forward and the per-token scores every task reads, at any parallel layout.

`EvalContext` says where this rank sits: its data-parallel share of the rows (`dp_rank` of `dp`) and its slice of
each sequence (`sp_rank` of `sp_size`, Ulysses). `score_rows` packs [B, T] rows like a training micro-batch
(training/step.py `pack_microbatch`: one [1, B*T] stream with document boundaries; under sequence parallelism this
rank's token slice), runs the model without labels under `no_grad` and returns, for the whole stream, each
target's negative log-likelihood (float64) and whether greedy decoding picks it: zero outside this rank's slice.
Tasks sum those per item and all-reduce the sums over every rank (`reduce_sum`): a sequence-parallel group's ranks
add their slices, data-parallel ranks their rows, so the totals do not depend on the layout.

`shard_rows` gives every data-parallel rank the same number of forwards (expert parallelism and ZeRO-3 need every
rank in every forward): a short last chunk is filled with padding rows that carry no target.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from model.k3 import IGNORE_INDEX, shift_targets
from training.distributed import all_reduce_sum
from training.step import pack_microbatch

_CE_ROWS = 1024  # logits rows upcast at a time


@dataclass
class EvalContext:
    module: torch.nn.Module
    device: torch.device
    dp_rank: int = 0
    dp: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    batch_rows: int = 4  # rows per rank per forward
    media_id: int | None = None
    model_config: Any = None  # the model's K3Config (tasks on images read its tower's geometry)
    out_dir: str | None = None  # where tasks write their tables / plots (the run dir); rank 0 only
    is_main: bool = True

    @classmethod
    def of_trainer(cls, trainer: Any, batch_rows: int) -> EvalContext:
        sp = int(trainer.ep.sp_size)
        return cls(
            trainer.module,
            trainer.device,
            trainer.info.rank // sp,
            int(trainer.dp),
            int(trainer.ep.sp_rank),
            sp,
            batch_rows,
            trainer.mcfg.media_placeholder_token_id,
            trainer.mcfg,
            str(trainer.run_dir),
            bool(trainer.is_main),
        )


@dataclass
class TokenScores:
    nll_N: torch.Tensor  # [B*T] float64: -log p(target) at each position whose target counts, else 0
    greedy_N: torch.Tensor  # [B*T] bool: argmax == target (only at counted positions of this rank's slice)
    targets_N: torch.Tensor  # [B*T] int64 whole-stream targets (-100 = not counted), identical on every rank


def batch_of(ids_RT: torch.Tensor, labels_RT: torch.Tensor, starts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Rows -> the loader's micro-batch dict (training/step.py packs it)."""
    T = ids_RT.shape[1]
    bounds = [i * T + s for i, st in enumerate(starts) for s in st] + [ids_RT.shape[0] * T]
    return {"input_ids": ids_RT, "labels": labels_RT, "cu_seqlens": torch.tensor(bounds, dtype=torch.int64)}


@torch.no_grad()
def score_rows(
    ctx: EvalContext,
    ids_RT: torch.Tensor,
    labels_RT: torch.Tensor,
    starts: list[list[int]],
    images: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> TokenScores:
    """`images`: the rows' (pixel_values, grid_thws) in row order (data/images.py `batch_images`), for a
    multimodal model; under sequence parallelism every rank of the group passes all of them (training/step.py)."""
    mb: dict[str, Any] = batch_of(ids_RT, labels_RT, starts)
    if images is not None:
        mb["pixel_values"], mb["grid_thws"] = images
    micro = pack_microbatch(mb, ctx.sp_size, ctx.sp_rank, ctx.media_id)
    N = ids_RT.numel()
    whole = shift_targets(mb["labels"].reshape(1, -1), mb["cu_seqlens"])[0]  # the whole stream's targets
    n = N // ctx.sp_size
    lo = ctx.sp_rank * n  # this rank's slice (pack_microbatch keeps tokens [lo, lo + n))
    targets_n = whole[lo : lo + n]
    inputs = micro.model_inputs(ctx.device)
    for key in ("labels", "targets"):  # no loss in the model: targets are scored here, in float64
        inputs.pop(key, None)
    out = ctx.module(**inputs)
    logits_nV = out.logits[0]
    del out
    nll_N = torch.zeros(N, dtype=torch.float64)
    greedy_N = torch.zeros(N, dtype=torch.bool)
    for s in range(0, logits_nV.shape[0], _CE_ROWS):
        l_CV = logits_nV[s : s + _CE_ROWS].float()
        t_C = targets_n[s : s + _CE_ROWS].to(l_CV.device)
        ok_C = t_C != IGNORE_INDEX
        tgt_C = l_CV.gather(-1, t_C.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        nll_C = torch.logsumexp(l_CV, dim=-1) - tgt_C
        nll_N[lo + s : lo + s + len(t_C)] = torch.where(ok_C, nll_C, 0.0).double().cpu()
        greedy_N[lo + s : lo + s + len(t_C)] = (ok_C & (l_CV.argmax(-1) == t_C)).cpu()
    return TokenScores(nll_N, greedy_N, whole)


def shard_rows(n_rows: int, ctx: EvalContext) -> Iterator[list[int | None]]:
    """Per forward, this rank's row indices (None = a padding row); every rank gets the same number of forwards."""
    per = ctx.batch_rows * ctx.dp
    for a in range(0, n_rows, per):
        mine = range(a + ctx.dp_rank * ctx.batch_rows, a + (ctx.dp_rank + 1) * ctx.batch_rows)
        yield [i if i < n_rows else None for i in mine]


def pad_rows(ids_RT: torch.Tensor, labels_RT: torch.Tensor, starts: list[list[int]], index: list[int | None]):
    """The rows at `index` (None: a padding row of token 0 with no target)."""
    T = ids_RT.shape[1]
    ids = torch.stack([ids_RT[i] if i is not None else torch.zeros(T, dtype=torch.int64) for i in index])
    labels = torch.stack([labels_RT[i] if i is not None else torch.full((T,), IGNORE_INDEX) for i in index])
    return ids, labels, [starts[i] if i is not None else [0] for i in index]


def reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over every rank (float64 on the wire): a sequence group's slices and the data-parallel rows."""
    return all_reduce_sum(t.double())
