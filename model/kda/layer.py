"""The KDA mixer layer (docs/model.md §3): projections, causal short conv + SiLU, L2-normed q/k, bounded
per-channel decay, delta-rule write strength beta, gated per-head RMSNorm output.

Attribute names are the HF checkpoint names (docs/model.md §12) so checkpoint IO only renames prefixes. `A_log` is kept
unpadded [H] here; the checkpoint pads it to a multiple of 128 (model/hf.py owns that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from model.config import K3Config
from model.kda.conv import causal_depthwise_conv, l2_normalize
from model.kda.ops import chunk_kda, recurrent_kda
from model.kda.tiled import tiled_kda_mixer
from model.norm import RMSNorm, upcast
from model.sequence import SequenceShard, head_slice


@dataclass
class KDACache:
    """Decode state of one KDA layer, created empty by the caller and updated in place by `KDA.forward`.

    recurrent_state: [B, H, K, V] fp32 (fp64 in fp64 runs).
    conv_state: the last W-1 *pre-conv* inputs of q, k, v, each [B, W-1, P] (zeros before the first token).
    """

    recurrent_state: torch.Tensor | None = None
    conv_state: dict[str, torch.Tensor] = field(default_factory=dict)
    seen_tokens: int = 0


def segment_starts(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """[T] index of the first token of each token's document."""
    cu = cu_seqlens.to(dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(cu[:-1], lengths, output_size=T)


class KDA(nn.Module):
    """Kimi Delta Attention mixer. `forward(x_BTD, cu_seqlens=None, cache=None) -> y_BTD`; x is already input-normed.

    The conv weights, A_log, dt_bias and o_norm are fp32 in the release (model/hf.py `FP32_SUFFIXES`, docs/model.md
    §12) and are read in fp32 here whatever their storage dtype.
    """

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        d = config.hidden_size
        self.num_heads = H = config.kda_num_heads
        self.head_dim = K = config.kda_head_dim
        self.conv_size = W = config.kda_conv_size
        self.gate_lower_bound = config.kda_gate_lower_bound
        self.use_full_rank_gate = config.kda_use_full_rank_gate
        self.chunk_size = config.kda_chunk_size
        P = H * K
        self.q_proj = nn.Linear(d, P, bias=False)
        self.k_proj = nn.Linear(d, P, bias=False)
        self.v_proj = nn.Linear(d, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False, dtype=torch.float32)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False, dtype=torch.float32)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False, dtype=torch.float32)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.f_a_proj = nn.Linear(d, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        if self.use_full_rank_gate:
            self.g_proj = nn.Linear(d, P, bias=False)
        else:  # Kimi-Linear low-rank output gate (with a bias on the up projection, docs/model.md §3)
            self.g_a_proj = nn.Linear(d, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=True)
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(P, d, bias=False)
        self.sequence_shard: SequenceShard | None = None  # set by sequence parallelism (model/sequence.py)
        self.tile_tokens = 0  # > 0 (training): the chunked core over recomputed tiles (model/kda/tiled.py)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Init (docs/model.md §3): Linear N(0, initializer_range), conv PyTorch default, A_log 0 (bounded gate;
        Kimi-Linear form: ln U[1, 16] as fla), dt_bias = log(expm1(dt)) with dt ~ exp(U[ln 1e-3, ln 1e-1]) >= 1e-4,
        o_norm 1."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.reset_parameters()
        if self.A_log.is_meta:  # shapes only (model/meta.py): no values to fill, and meta maths imports dynamo
            return
        if self.gate_lower_bound is not None:
            self.A_log.zero_()
        else:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus, stable form of log(expm1(dt))
        self.o_norm.reset_parameters()

    # --- gates ------------------------------------------------------------------------------------------------
    def decay(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Log-space per-channel decay g [B, T, H, K] in fp32: g_min*sigmoid(exp(A)(z+dt_bias)) in (g_min, 0), or
        Kimi-Linear's -exp(A)*softplus(z+dt_bias) when gate_lower_bound is null."""
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        z = upcast(self.f_b_proj(self.f_a_proj(x_BTD))) + upcast(self.dt_bias)
        z_BTHK = z.view(B, T, H, K)
        A_H11 = upcast(self.A_log).exp().view(H, 1)
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(A_H11 * z_BTHK)
        return -A_H11 * F.softplus(z_BTHK)

    def output_gate(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """sigmoid of the (full- or low-rank) output-gate projection, [B, T, P] in fp32."""
        logits = self.g_proj(x_BTD) if self.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x_BTD))
        return torch.sigmoid(upcast(logits))

    # --- forward ----------------------------------------------------------------------------------------------
    def forward(
        self,
        x_BTD: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache: KDACache | None = None,
        cu_seqlens_host: list[int] | None = None,
    ) -> torch.Tensor:
        """`cu_seqlens_host`: the same boundaries as Python ints (read once per micro-batch by the model), so the
        layer reads nothing from the device; None: read here, once. With `sequence_shard` set, x holds this
        rank's T/N tokens and cu_seqlens the whole sequence's documents: projections and gates run on the local
        tokens, the short conv and the recurrence on all T tokens of this rank's head group (model/sequence.py),
        the output norm, gate and projection on the local tokens again."""
        if x_BTD.dim() != 3 or x_BTD.shape[-1] != self.config.hidden_size:
            raise ValueError(f"KDA expects x [B, T, {self.config.hidden_size}], got {tuple(x_BTD.shape)}")
        if cu_seqlens is not None and cache is not None:
            raise ValueError("KDA: pass either cu_seqlens (packed training) or cache (decoding), not both")
        if cu_seqlens is not None and x_BTD.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (packed documents), got B={x_BTD.shape[0]}")
        shard = self.sequence_shard
        if shard is not None and cache is not None:
            raise ValueError("KDA: a decode cache cannot be combined with sequence parallelism")
        B, t, _ = x_BTD.shape
        T = t * shard.size if shard is not None else t  # the whole sequence the mixer core sees
        H, K = self.num_heads, self.head_dim
        if cu_seqlens is not None:
            cu = cu_seqlens.tolist() if cu_seqlens_host is None else cu_seqlens_host
            if cu_seqlens.dim() != 1 or cu[0] != 0 or cu[-1] != T:
                raise ValueError(f"cu_seqlens must be 1-D cumulative lengths from 0 to T={T}, got {cu}")
            cu_seqlens_host = cu
        seg_T = segment_starts(cu_seqlens, T) if cu_seqlens is not None else None
        heads = head_slice(shard, H) if shard is not None else slice(0, H)
        h = heads.stop - heads.start

        def whole_sequence(x_BtHX: torch.Tensor) -> torch.Tensor:  # [B, t, H, X] -> [B, T, h, X]
            return shard.to_head_shard(x_BtHX) if shard is not None else x_BtHX

        tiled = self.tile_tokens > 0 and cache is None and self.training and torch.is_grad_enabled()
        convs, pre = {}, {}
        for name in ("q", "k", "v"):
            u_BTP = whole_sequence(getattr(self, f"{name}_proj")(x_BTD).view(B, t, H, K)).reshape(B, T, h * K)
            weight_PW = getattr(self, f"{name}_conv1d").weight[heads.start * K : heads.stop * K, 0]
            if tiled:  # the conv runs inside the tiles (model/kda/tiled.py)
                pre[name] = (u_BTP, weight_PW)
                continue
            prefix = cache.conv_state.get(name) if cache is not None else None
            convs[name] = F.silu(causal_depthwise_conv(u_BTP, weight_PW, prefix, seg_T))
            if cache is not None:
                hist = torch.cat(
                    [prefix if prefix is not None else u_BTP.new_zeros(B, self.conv_size - 1, u_BTP.shape[-1]), u_BTP],
                    dim=1,
                )
                cache.conv_state[name] = hist[:, hist.shape[1] - (self.conv_size - 1) :].detach()
        beta_BTH = whole_sequence(torch.sigmoid(upcast(self.b_proj(x_BTD))).unsqueeze(-1)).squeeze(-1)
        g_BTHK = whole_sequence(self.decay(x_BTD))

        if tiled:
            us, ws = [pre[n][0] for n in "qkv"], [pre[n][1] for n in "qkv"]
            shape = (h, K)
            o_BTHV = tiled_kda_mixer(
                us,
                ws,
                g_BTHK,
                beta_BTH,
                self.tile_tokens,
                shape,
                cu_seqlens,
                seg_T,
                self.chunk_size,
                lower_bound=self.gate_lower_bound,
                cu_seqlens_host=cu_seqlens_host,
            )
            return self._output(x_BTD, o_BTHV.to(x_BTD.dtype), shard, B, t)
        q_BTHK = l2_normalize(convs["q"].view(B, T, h, K))
        k_BTHK = l2_normalize(convs["k"].view(B, T, h, K))
        v_BTHV = convs["v"].view(B, T, h, K)
        initial_state = cache.recurrent_state if cache is not None else None
        if T == 1 and cache is not None:  # a decode step
            o_BTHV, state = recurrent_kda(
                q_BTHK,
                k_BTHK,
                v_BTHV,
                g_BTHK,
                beta_BTH,
                initial_state=initial_state,
                output_final_state=cache is not None,
                cu_seqlens=cu_seqlens,
            )
        else:
            o_BTHV, state = chunk_kda(
                q_BTHK,
                k_BTHK,
                v_BTHV,
                g_BTHK,
                beta_BTH,
                initial_state=initial_state,
                output_final_state=cache is not None,
                cu_seqlens=cu_seqlens,
                chunk_size=self.chunk_size,
                lower_bound=self.gate_lower_bound,  # g in [bound, 0] by construction (decay)
                cu_seqlens_cpu=cu_seqlens_host,
            )
        if cache is not None:
            assert state is not None  # output_final_state=True
            cache.recurrent_state = state.detach()
            cache.seen_tokens += T

        return self._output(x_BTD, o_BTHV, shard, B, t)

    def _output(self, x_BTD, o_BTHV, shard, B: int, t: int) -> torch.Tensor:
        """Back to this rank's tokens, per-head output norm, output gate, o_proj."""
        H, K = self.num_heads, self.head_dim
        if shard is not None:
            o_BTHV = shard.to_token_shard(o_BTHV)  # [B, T, h, V] -> [B, t, H, V]
        o_BTHV = self.o_norm(o_BTHV)  # per-head RMSNorm, weight [K] shared by heads (fp32 here)
        y_BTP = (self.output_gate(x_BTD) * o_BTHV.reshape(B, t, H * K)).to(x_BTD.dtype)
        return self.o_proj(y_BTP)
