"""QK-Clip (Kimi K2, MuonClip): after each optimizer step, shrink the MLA heads whose attention logits grew past tau.

S_h is the largest pre-softmax logit of MLA head h over the step (every micro-batch: `GatedMLA.max_logit_H`),
reduced with MAX over the whole world (data-, expert- and sequence-parallel ranks all saw tokens; a sequence-
parallel rank reports only its own heads, the others -inf). gamma_h = min(1, tau / max(S_h, 1e-6)); the head's
q-nope rows (of `q_b_proj` / `q_proj`) and its k-nope rows of `kv_b_proj` are scaled by sqrt(gamma_h), its q-pe rows
by gamma_h, so every logit of the head, q_n.k_n + q_pe.k_r, is scaled by gamma_h: the step's largest becomes tau.
The key part shared by all heads (`kv_a_proj_with_mqa`) and the value rows are left alone. KDA has no softmax.

The scale reaches DeepSpeed's fp32 master and the working weights in the same step, whatever the ZeRO stage:
`safe_get_full_fp32_param` / `safe_set_full_fp32_param` (deepspeed.utils, collective: ZeRO-1/2 fragments via
`_hp_mapping`, ZeRO-3 partitions via `_z3_optimizer`) for the master, then the working copy from it (ZeRO-1/2 and
bf16: the full module parameter on every rank; ZeRO-3: `GatheredParameters(modifier_rank=0)` re-partitions it).
ZeRO-0 fp32 has no second copy: the module parameter is the master.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from model.mla import GatedMLA


class QKClip:
    """Tracks the MLA layers' max logits (`begin_step`) and clips them after the step (`after_step`)."""

    def __init__(self, model: nn.Module, tau: float | None):
        self.tau = None if tau is None else float(tau)
        self.layers: list[tuple[int, GatedMLA]] = [(m.layer_idx, m) for m in model.modules() if isinstance(m, GatedMLA)]

    def begin_step(self, track: bool) -> None:
        """Track this step's logits when clipping or when they will be logged."""
        for _, m in self.layers:
            m.track_max_logit, m.max_logit_H = bool(track) or self.tau is not None, None

    def global_max_logits(self) -> torch.Tensor | None:
        """[L_mla, H] fp32 on the collective's device, MAX over micro-batches and every rank (collective), or None
        if nothing was tracked."""
        if not self.layers or not self.layers[0][1].track_max_logit:
            return None
        device = self.layers[0][1].kv_b_proj.weight.device  # the collective's device (NCCL: the GPU)
        rows = []
        for _, m in self.layers:
            v = m.max_logit_H
            rows.append(v if v is not None else torch.full((m.num_heads,), float("-inf"), device=device))
        s_LH = torch.stack([r.float().to(device) for r in rows])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(s_LH, op=dist.ReduceOp.MAX)
        return s_LH

    def after_step(self, applied: bool) -> dict[str, float]:
        """Collective on every rank: metrics of the step and, when `applied` and tau is set, the clip.

        The step's one device->host read: every layer's per-head maxima in a single `tolist` (no scalar read per
        layer); the metrics, the clip factors and which layers to clip are computed on the host from it."""
        s_LH = self.global_max_logits()
        for _, m in self.layers:
            m.track_max_logit, m.max_logit_H = False, None
        if s_LH is None:
            return {}
        host_LH: list[list[float]] = s_LH.tolist()
        out: dict[str, float] = {"attn/max_logit": max(max(row) for row in host_LH)}
        for (idx, _), row in zip(self.layers, host_LH):
            out[f"attn/layer{idx}/max_logit"] = max(row)
        if self.tau is not None:
            gamma_LH = clip_factors(torch.tensor(host_LH, dtype=torch.float32), self.tau)  # built on the host
            clipped = [[math.isfinite(v) and max(v, 1e-6) > self.tau for v in row] for row in host_LH]
            out["optim/qk_clip_heads"] = float(sum(map(sum, clipped))) if applied else 0.0
            if applied:
                for (_, m), g_H, row in zip(self.layers, gamma_LH, clipped):
                    if any(row):
                        clip_layer(m, g_H)
        return out


def clip_factors(s_LH: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma = min(1, tau / max(S, 1e-6)) (1 for a head that saw no token)."""
    g = (tau / s_LH.clamp_min(1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(s_LH), g, torch.ones_like(g))


def row_scales(m: GatedMLA, gamma_H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row factors of the query projection [H*(dn+dr)] and of kv_b_proj [H*(dn+dv)], float64."""
    g = gamma_H.double()
    root = g.sqrt()
    q_HE = torch.cat([root[:, None].expand(-1, m.nope_dim), g[:, None].expand(-1, m.rope_dim)], dim=1)
    kv_HF = torch.cat([root[:, None].expand(-1, m.nope_dim), torch.ones(len(g), m.v_dim, dtype=g.dtype)], dim=1)
    return q_HE.reshape(-1), kv_HF.reshape(-1)


@torch.no_grad()
def clip_layer(m: GatedMLA, gamma_H: torch.Tensor) -> None:
    """Scale one MLA layer's query and kv_b rows (collective under ZeRO: every rank calls it for the same layers)."""
    q_R, kv_R = row_scales(m, gamma_H)
    q_proj = m.q_proj if m.q_lora_rank is None else m.q_b_proj
    scale_rows(q_proj.weight, q_R)
    scale_rows(m.kv_b_proj.weight, kv_R)


@torch.no_grad()
def scale_rows(p: nn.Parameter, scale_R: torch.Tensor) -> None:
    """p[r, :] *= scale_R[r] in DeepSpeed's fp32 master (if any) and in the working weights."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    full = safe_get_full_fp32_param(p)
    if full is None:  # ZeRO-0 fp32: the module parameter is the master
        p.copy_((p.double() * scale_R.to(p.device)[:, None]).to(p.dtype))
        return
    shape = tuple(getattr(p, "ds_shape", p.shape))
    new = (full.double().view(shape) * scale_R.to(full.device)[:, None]).to(full.dtype)
    safe_set_full_fp32_param(p, new)
    if hasattr(p, "ds_id"):  # ZeRO-3: rank 0's full value is re-partitioned into every rank's ds_tensor
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([p], modifier_rank=0):
            p.data.copy_(new.to(p.dtype))
    else:
        p.data.copy_(new.to(p.dtype).view_as(p))
