"""Multi-token prediction (DeepSeek-V3 §2.2 layout; K3 report Table 1 lists one MTP layer): `mtp_depth` = D extra
blocks after the L decoder layers, each of the backbone's MLA + MoE shape, plain PreNorm (no AttnRes, no KDA).

Depth k (1..D) at position t sees the previous depth's hidden state h_{k-1}[t] (h_0: the main model's final-normed
output) and the embedding of token t+k, and predicts token t+1+k through the *shared* final norm and lm_head:

    x_k = eh_proj([enorm(emb(token_{t+k})) ; hnorm(h_{k-1})])      # eh_proj: [D, 2D], embedding half first
    h_k = block_k(x_k)                                             # MLA + MoE decoder layer, causal
    logits_k = lm_head(norm(h_k))                                  # predicts token t+1+k

The concatenation order (embedding first) is the released DeepSeek-V3 checkpoints' (vLLM `deepseek_mtp.py`), so
their `eh_proj` loads as is. The blocks are `K3DecoderLayer`s at indices L..L+D-1 of `model.layers`, so their
state-dict names are DeepSeek-V3's `model.layers.{L+k-1}.{enorm,hnorm,eh_proj,self_attn,block_sparse_moe,...}`
without any renaming, and `moe_layers()` (router metrics, balancing, EP) includes them.

Loss: main CE + `mtp_weight` x mean over depths of each depth's mean CE. Depth k's targets are the main
(already shifted) targets moved k positions left: positions whose target lies past the end of the sequence or in
another packed document (cu_seqlens) are -100, and -100 labels stay -100. The inputs past the end are zero
embeddings; causal attention keeps them out of every counted position.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from model.loss import IGNORE_INDEX
from model.norm import RMSNorm
from model.sequence import SequenceShard, gather_shared

log = logging.getLogger(__name__)


class EHProj(nn.Linear):
    """`eh_proj` [D, 2D]: the concatenated (embedding, hidden) pair back to the model width; N(0, init_range)."""

    std: float = 0.02

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


def add_mtp_inputs(layer: Any, hidden_size: int, eps: float, std: float) -> None:
    """Give an MTP decoder layer its DeepSeek-V3 input modules `enorm`, `hnorm`, `eh_proj` (HF names)."""
    layer.enorm = RMSNorm(hidden_size, eps)
    layer.hnorm = RMSNorm(hidden_size, eps)
    layer.eh_proj = EHProj(2 * hidden_size, hidden_size, bias=False)
    layer.eh_proj.std = std
    layer.eh_proj.reset_parameters()


def shift_left(x_BT: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t + k] at position t (dim 1); zeros where t + k runs past the end."""
    out = torch.zeros_like(x_BT)
    T = x_BT.shape[1]
    if k < T:
        out[:, : T - k] = x_BT[:, k:]
    return out


def depth_targets(
    targets_BT: torch.Tensor,
    k: int,
    cu_seqlens: torch.Tensor | None = None,
    halo_BD: torch.Tensor | None = None,
    start: int = 0,
) -> torch.Tensor:
    """Depth k's targets from the main ones (`targets[t]` = token t+1): token t+1+k at position t, -100 past the
    end and where t and t+k lie in different packed documents. Sequence parallelism: `targets_BT` is a shard
    starting at global position `start` (cu_seqlens the whole sequence's) and `halo_BD` the next shard's first
    targets (-100 after the last shard)."""
    out = torch.full_like(targets_BT, IGNORE_INDEX)
    T = targets_BT.shape[1]
    if halo_BD is not None:
        ext = torch.cat([targets_BT, halo_BD.to(targets_BT.dtype)], dim=1)
        n = min(T, ext.shape[1] - k)
        out[:, :n] = ext[:, k : k + n]
        if cu_seqlens is not None:
            pos = torch.arange(start, start + T, device=targets_BT.device)
            ends = cu_seqlens[1:].to(pos.device, torch.long)
            crosses = torch.searchsorted(ends, pos, right=True) != torch.searchsorted(ends, pos + k, right=True)
            out[:, crosses] = IGNORE_INDEX
        return out
    if k >= T:
        return out
    out[:, : T - k] = targets_BT[:, k:]
    if cu_seqlens is not None:
        pos = torch.arange(T, device=targets_BT.device)
        doc = torch.searchsorted(cu_seqlens[1:].to(pos.device, torch.long), pos, right=True)  # document of t
        crosses = torch.ones(T, dtype=torch.bool, device=pos.device)
        crosses[: T - k] = doc[: T - k] != doc[k:]
        out[:, crosses] = IGNORE_INDEX
    return out


def next_shard_head(shard: SequenceShard, x_BtX: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """The next sequence shard's first `rows` rows of `x` ([B, rows, X]; `fill` after the last shard), through the
    seam's all-gather of every shard's first rows (differentiable: its backward is the reduce-scatter)."""
    if x_BtX.shape[1] < rows:
        raise ValueError(
            f"MTP depth {rows} needs at least {rows} tokens per sequence shard, got {x_BtX.shape[1]}; "
            "lower model.mtp_depth or parallel.sp_size"
        )
    heads_BNrX = gather_shared(shard, x_BtX[:, :rows].contiguous())  # [B, N*rows, X], shard r's rows at r*rows
    r = shard.rank + 1
    if r == shard.size:  # still on the gathered tensor: every rank's backward must join the reduce-scatter
        return heads_BNrX[:, :rows] * 0 + fill
    return heads_BNrX[:, r * rows : (r + 1) * rows]


def _sharded_inputs(shard: SequenceShard, embeds_BTD: torch.Tensor, targets_BT: torch.Tensor, D: int):
    """(embeddings with the next shard's first D rows appended [B, t+D, X], the next shard's first D targets)."""
    emb_halo = next_shard_head(shard, embeds_BTD, D, 0.0)
    # ids and -100 are exact in float64 (< 2^53), so the targets cross the same seam as the activations
    tgt_halo = next_shard_head(shard, targets_BT.to(torch.float64).unsqueeze(-1), D, float(IGNORE_INDEX))
    return torch.cat([embeds_BTD, emb_halo], dim=1), tgt_halo.squeeze(-1).round().to(targets_BT.dtype)


def mtp_block(layer: Any, h_BTD: torch.Tensor, emb_BTD: torch.Tensor, cu_seqlens=None, cache=None, cu_host=None):
    """One depth on aligned inputs: `h` the previous depth's hidden state, `emb` the embedding of the token to
    condition on. Returns (h_k pre-norm, RouterStats | None)."""
    x = layer.eh_proj(torch.cat([layer.enorm(emb_BTD), layer.hnorm(h_BTD)], dim=-1))
    _, h, stats = layer([], x, cu_seqlens, cache, cu_seqlens_host=cu_host)
    return h, stats


def mtp_losses(
    lm: Any, hidden_BTD: torch.Tensor, embeds_BTD: torch.Tensor | None, targets_BT, cu_seqlens=None, cu_host=None
):
    """Per depth (mean CE, counted targets), and the MTP blocks' RouterStats, for a K3ForCausalLM `lm` whose main
    forward gave `hidden_BTD` (final-normed) from `embeds_BTD` with (shifted) `targets_BT`. Under sequence
    parallelism (`lm.sequence_shard`) these are this shard's: its positions' CE mean and count, the inputs and
    targets of its last positions taken from the next shard (`next_shard_head`)."""
    assert embeds_BTD is not None, "mtp_losses needs the input embeddings"
    L, D = lm.config.num_hidden_layers, lm.config.mtp_depth
    shard = lm.sequence_shard
    if shard is not None:
        t = embeds_BTD.shape[1]
        ext_BSD, halo_BD = _sharded_inputs(shard, embeds_BTD, targets_BT, D)
    losses, stats = [], []
    h = hidden_BTD
    for k in range(1, D + 1):
        if shard is None:
            emb, tgt = shift_left(embeds_BTD, k), depth_targets(targets_BT, k, cu_seqlens)
        else:
            emb = ext_BSD[:, k : k + t]
            tgt = depth_targets(targets_BT, k, cu_seqlens, halo_BD, shard.rank * t)
        h, s = mtp_block(lm.model.layers[L + k - 1], h, emb, cu_seqlens, cu_host=cu_host)
        if s is not None:
            stats.append(s)
        loss, count, _ = lm.lm_loss(lm.model.norm(h), tgt)
        losses.append((loss, count))
    return losses, stats


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_SHARED_COPIES = ("embed_tokens.", "shared_head.")  # DeepSeek-V3 repeats the shared embedding/head per MTP layer


def drop_unused_mtp_tensors(hf_state: dict, num_hidden_layers: int, mtp_depth: int, path: str) -> dict:
    """The checkpoint's tensors minus MTP blocks past `mtp_depth` (a checkpoint with MTP loaded into a model with
    fewer or none) and DeepSeek-V3's per-MTP-layer copies of the shared embedding / head; each drop is logged in
    one line, never silent. Other keys pass through (unknown ones are load's to report)."""
    past, copies = [], []
    for key in hf_state:
        m = _LAYER_KEY.match(key)
        if m and int(m.group(1)) >= num_hidden_layers:
            if int(m.group(1)) >= num_hidden_layers + mtp_depth:
                past.append(key)
            elif m.group(2).startswith(_SHARED_COPIES):
                copies.append(key)
    if past:
        blocks = sorted({int(_LAYER_KEY.match(k).group(1)) for k in past})  # type: ignore[union-attr]
        log.warning(
            f"load_hf_checkpoint: the model has mtp_depth={mtp_depth}: dropping {len(past)} tensors of the MTP "
            f"block(s) model.layers.{blocks} of {path}"
        )
    if copies:
        log.warning(f"load_hf_checkpoint: dropping {len(copies)} per-MTP-layer copies of the shared embedding/head")
    drop = set(past) | set(copies)
    return {k: t for k, t in hf_state.items() if k not in drop}
