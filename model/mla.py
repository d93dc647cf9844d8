"""Gated NoPE Multi-head Latent Attention (docs/model.md §4): q-LoRA, a shared 576-d latent KV stream, sigmoid
output gate.

K3's MLA has no RoPE, so the per-head key `k_h = [W_UK_h c_hat ; k_r]` never rotates and the up-projection can be
folded into the query (the "absorbed" form): attention becomes MQA over one `[c_hat ; k_r]` stream per token. Both
forms are implemented; training uses the naive per-head form (cheap at long T with SDPA), the decode cache uses the
absorbed form, which needs only `r_kv + d_r` cached values per token (576 for K3) instead of `H * (d_n + d_r + d_v)`.

Parameter names are the HF keys (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`, `g_proj`) so checkpoint IO is a prefix rename only.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.attention_backend import flex_document_attention, packed_backend
from model.config import K3Config
from model.lora import effective_weight
from model.norm import RMSNorm, upcast
from model.sequence import SequenceShard, gather_shared, head_slice

# NeMo/BatchGen/mlxcel build both latent norms with eps 1e-6, not rms_norm_eps (docs/model.md §12).
MLA_LATENT_NORM_EPS = 1e-6


@dataclass
class MLACache:
    """Per-layer decode cache: the post-norm KV latent and the shared (unrotated) key part, `r_kv + d_r` per token.

    Created empty by the caller; `GatedMLA.forward(..., cache=c)` appends the new tokens in place.
    """

    c_kv: torch.Tensor | None = None  # [B, S, r_kv]  c_hat = RMSNorm(c), post-norm
    k_r: torch.Tensor | None = None  # [B, S, d_r]    shared by all heads, NoPE

    def append(self, c_kv_BTR: torch.Tensor, k_r_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' latents; returns the full cached (c_kv, k_r) including them."""
        if self.c_kv is None or self.k_r is None:
            self.c_kv, self.k_r = c_kv_BTR, k_r_BTD
        else:
            if self.c_kv.shape[0] != c_kv_BTR.shape[0]:
                raise ValueError(
                    f"MLACache holds batch {self.c_kv.shape[0]} but got batch {c_kv_BTR.shape[0]}; "
                    "use one cache per sequence batch (create a fresh MLACache())"
                )
            self.c_kv = torch.cat([self.c_kv, c_kv_BTR.to(self.c_kv.dtype)], dim=1)
            self.k_r = torch.cat([self.k_r, k_r_BTD.to(self.k_r.dtype)], dim=1)
        return self.c_kv, self.k_r


# --- pure functions ---------------------------------------------------------------------------------------------


def segment_ids(cu_seqlens: torch.Tensor, total_len: int) -> torch.Tensor:
    """Document index of every packed position: [T] int64 (cu_seqlens = [0, l0, l0+l1, ..., T])."""
    pos_T = torch.arange(total_len, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64), pos_T, right=True)


def attention_mask(
    q_len: int, kv_len: int, cu_seqlens: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(bool mask [T, S] or None, is_causal) for SDPA.

    Queries are the last `q_len` of `kv_len` positions (a cache may hold earlier ones). Without packing and without
    an offset this is plain `is_causal` (lets fused kernels skip the mask); a single decode token sees everything.
    With cu_seqlens the mask is block-diagonal causal: same segment id and key position <= query position.
    """
    offset = kv_len - q_len
    if cu_seqlens is None:
        if offset == 0:
            return None, q_len > 1
        if q_len == 1:
            return None, False
        return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=offset), False
    seg_T = segment_ids(cu_seqlens.to(device), kv_len)  # offset is 0 here: cache and cu_seqlens are exclusive
    pos_T = torch.arange(kv_len, device=device)
    mask_TS = (seg_T[:, None] == seg_T[None, :]) & (pos_T[None, :] <= pos_T[:, None])
    return mask_TS, False


def sdpa(
    q_BHTE: torch.Tensor,
    k_BHSE: torch.Tensor,
    v_BHSV: torch.Tensor,
    mask_TS: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v. SDPA's fused kernels (flash, memory-efficient, CPU flash) keep the softmax
    in fp32 for bf16/fp16 inputs and fp64 inputs stay fp64: docs/model.md §4's "softmax in ≥ fp32"."""
    E, V = q_BHTE.shape[-1], v_BHSV.shape[-1]
    if mask_TS is None and q_BHTE.device.type == "cpu" and V < E:
        # PyTorch's CPU flash kernel needs equal head dims; padding v with zeros selects it over the math path
        # (which materialises the T x S scores and probabilities and skips no causal work): 1.8x at T = 2048
        o_BHTE = F.scaled_dot_product_attention(
            q_BHTE, k_BHSE, F.pad(v_BHSV, (0, E - V)), is_causal=is_causal, scale=scale
        )
        return o_BHTE[..., :V]
    return F.scaled_dot_product_attention(q_BHTE, k_BHSE, v_BHSV, attn_mask=mask_TS, is_causal=is_causal, scale=scale)


def naive_mla_attention(
    q_BTHE: torch.Tensor,
    c_kv_BSR: torch.Tensor,
    k_r_BSD: torch.Tensor,
    w_kvb: torch.Tensor,
    num_heads: int,
    nope_dim: int,
    v_dim: int,
    mask_TS: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """Per-head keys/values from the latent: k_h = [W_UK_h c_hat ; k_r], v_h = W_UV_h c_hat. Returns [B, T, H, dv]."""
    k_BSHE, v_BSHV = per_head_kv(c_kv_BSR, k_r_BSD, w_kvb, num_heads, nope_dim, v_dim)
    o_BHTV = sdpa(q_BTHE.transpose(1, 2), k_BSHE.transpose(1, 2), v_BSHV.transpose(1, 2), mask_TS, is_causal, scale)
    return o_BHTV.transpose(1, 2)


def per_head_kv(
    c_kv_BSR: torch.Tensor, k_r_BSD: torch.Tensor, w_kvb: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k_h = [W_UK_h c_hat ; k_r] [B, S, H, dn + dr] and v_h = W_UV_h c_hat [B, S, H, dv] from the latent."""
    B, S, _ = c_kv_BSR.shape
    kv_BSHF = F.linear(c_kv_BSR, w_kvb).view(B, S, num_heads, nope_dim + v_dim)
    k_nope_BSHN, v_BSHV = kv_BSHF.split([nope_dim, v_dim], dim=-1)
    k_r_BSHD = k_r_BSD[:, :, None, :].expand(B, S, num_heads, k_r_BSD.shape[-1])
    return torch.cat([k_nope_BSHN, k_r_BSHD], dim=-1), v_BSHV


def flex_mla_attention(
    q_BTHE: torch.Tensor,
    c_kv_BSR: torch.Tensor,
    k_r_BSD: torch.Tensor,
    w_kvb: torch.Tensor,
    num_heads: int,
    nope_dim: int,
    v_dim: int,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The naive per-head form over all packed documents in one FlexAttention call with a document block mask
    (model/attention_backend.py; qk head dim dn + dr, v head dim dv). Returns [B, T, H, dv]."""
    k_BSHE, v_BSHV = per_head_kv(c_kv_BSR, k_r_BSD, w_kvb, num_heads, nope_dim, v_dim)
    o_BHTV = flex_document_attention(
        q_BTHE.transpose(1, 2), k_BSHE.transpose(1, 2), v_BSHV.transpose(1, 2), cu_seqlens, scale
    )
    return o_BHTV.transpose(1, 2)


def absorbed_mla_attention(
    q_BTHE: torch.Tensor,
    c_kv_BSR: torch.Tensor,
    k_r_BSD: torch.Tensor,
    w_kvb: torch.Tensor,
    num_heads: int,
    nope_dim: int,
    v_dim: int,
    mask_TS: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """MQA over the shared [c_hat ; k_r] stream (docs/model.md §4): q~_h = [W_UK_h^T q_h^n ; q_h^r],
    o_h = W_UV_h sum_s p c_hat.

    Exact because NoPE keys are never rotated, so W_UK_h commutes out of the score. Returns [B, T, H, dv].
    """
    B, T, H, _ = q_BTHE.shape
    S, R = c_kv_BSR.shape[1], c_kv_BSR.shape[2]
    w_HFR = w_kvb.view(num_heads, nope_dim + v_dim, R)  # per-head rows [k_nope (dn); v (dv)]
    w_uk_HNR, w_uv_HVR = w_HFR.split([nope_dim, v_dim], dim=1)
    q_nope_BTHN, q_r_BTHD = q_BTHE.split([nope_dim, q_BTHE.shape[-1] - nope_dim], dim=-1)
    q_lat_BTHR = torch.einsum("bthn,hnr->bthr", q_nope_BTHN, w_uk_HNR)
    q_BTHC = torch.cat([q_lat_BTHR, q_r_BTHD], dim=-1)  # C = r_kv + d_r
    # One key/value stream shared by every head: fold heads into the query axis, a single-KV-head SDPA.
    q_B1MC = q_BTHC.reshape(B, 1, T * H, q_BTHC.shape[-1])  # M = T*H, row m = (t, h)
    kv_B1SC = torch.cat([c_kv_BSR, k_r_BSD], dim=-1)[:, None]
    if is_causal:  # only ever set when S == T (no cache offset)
        mask_TS = torch.ones(T, S, dtype=torch.bool, device=q_BTHE.device).tril()
    mask_MS = None if mask_TS is None else mask_TS.repeat_interleave(H, dim=0)
    o_lat_B1MR = sdpa(q_B1MC, kv_B1SC, c_kv_BSR[:, None], mask_MS, False, scale)
    o_lat_BTHR = o_lat_B1MR.view(B, T, H, R)
    return torch.einsum("bthr,hvr->bthv", o_lat_BTHR, w_uv_HVR)


@torch.no_grad()
def mla_max_logits(
    q_BTHE: torch.Tensor,
    c_kv_BSR: torch.Tensor,
    k_r_BSD: torch.Tensor,
    w_kvb: torch.Tensor,
    nope_dim: int,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_host: list[int] | None = None,
    chunk: int = 128,
) -> torch.Tensor:
    """Per head, the largest pre-softmax logit scale * q_h . k_h,s over the causal pairs (within each document when
    packed): [H], >= fp32 (-inf for a head with none). For QK-Clip (training/optim/qk_clip.py).

    Queries are the last T of S positions (a decode cache may hold earlier ones; packing has no cache). Queries go in
    chunks of `chunk`; a chunk scores only the keys from the start of its first query's document (from
    `cu_seqlens_host`, 0 without it) to its last query, masked by the per-position document start taken on the device
    from `cu_seqlens`: no [T, T] tensor, and [B, H, chunk, chunk + longest document] scores at most."""
    B, T, H, _ = q_BTHE.shape
    S, offset = c_kv_BSR.shape[1], c_kv_BSR.shape[1] - q_BTHE.shape[1]
    dt = torch.promote_types(q_BTHE.dtype, torch.float32)
    k_nope_BSHN = F.linear(c_kv_BSR, w_kvb).view(B, S, H, -1)[..., :nope_dim]
    k_BHSE = torch.cat([k_nope_BSHN, k_r_BSD[:, :, None, :].expand(B, S, H, k_r_BSD.shape[-1])], -1).transpose(1, 2)
    pos_S = torch.arange(S, device=q_BTHE.device)
    start_S = None  # [S] first position of each position's document
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=q_BTHE.device, dtype=torch.int64)
        start_S = cu[segment_ids(cu, S)]
    out_H = torch.full((H,), float("-inf"), dtype=dt, device=q_BTHE.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        k0 = 0 if cu_seqlens_host is None else cu_seqlens_host[bisect.bisect_right(cu_seqlens_host, t0 + offset) - 1]
        q_pos, k_pos = pos_S[t0 + offset : t1 + offset], pos_S[k0 : t1 + offset]
        allowed_tW = k_pos[None, :] <= q_pos[:, None]
        if start_S is not None:
            allowed_tW &= k_pos[None, :] >= start_S[t0 + offset : t1 + offset, None]
        s_BHtW = torch.einsum("bthe,bhwe->bhtw", q_BTHE[:, t0:t1].to(dt), k_BHSE[:, :, k0 : t1 + offset].to(dt))
        s_BHtW = (s_BHtW * scale).masked_fill(~allowed_tW, float("-inf"))
        out_H = torch.maximum(out_H, s_BHtW.amax(dim=(0, 2, 3)))
    return out_H


# --- module -----------------------------------------------------------------------------------------------------


class GatedMLA(nn.Module):
    """Gated NoPE MLA mixer: `forward(x_BTD, cu_seqlens=None, cache=None) -> y_BTD` (x already input-normed)."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = d = config.hidden_size
        self.num_heads = H = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim  # the shared, *unrotated* key part (name kept from HF)
        self.v_dim = config.v_head_dim
        self.q_head_dim = config.mla_q_head_dim
        self.scale = self.q_head_dim**-0.5
        self.use_output_gate = config.mla_use_output_gate
        self.initializer_range = config.initializer_range

        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * self.q_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=MLA_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, d, bias=False)
        if self.use_output_gate:
            self.g_proj = nn.Linear(d, H * self.v_dim, bias=False)
        self.sequence_shard: SequenceShard | None = None  # set by sequence parallelism (model/sequence.py)
        # QK-Clip's seam (training/optim/qk_clip.py): while `track_max_logit`, each forward raises `max_logit_H`
        # [H] to the largest pre-softmax logit per head it saw (heads this rank does not own stay -inf)
        self.track_max_logit = False
        self.max_logit_H: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Linear N(0, initializer_range), norms 1 (docs/model.md §4: no near-identity gate init)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=self.initializer_range)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()

    def _query(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        return q.view(B, T, self.num_heads, self.q_head_dim)  # [B, T, H, dn + dr]

    def _latent(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c_BTR, k_r_BTD = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(c_BTR), k_r_BTD  # c_hat [B, T, r_kv], k_r [B, T, d_r] (k_r is not normed)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache: MLACache | None = None,
        absorbed: bool | None = None,
        *,
        cu_seqlens_host: list[int] | None = None,
    ) -> torch.Tensor:
        """`absorbed` picks the attention form (default: absorbed iff a cache is given); both are exact.

        Packed documents: `cu_seqlens` on the device and, when the caller has them, the same boundaries as Python
        ints in `cu_seqlens_host` (the model reads them once per micro-batch); without them this layer reads
        `cu_seqlens` at most once, and only where a path needs ints (the per-document path, CPU validation).

        With `sequence_shard` set, x holds this rank's T/N tokens: queries go to [T, H/N] by the head all-to-all,
        the head-shared latent stream is gathered whole, this rank's heads attend over every token (documents from
        the whole sequence's cu_seqlens) and the outputs return to the token shard (model/sequence.py)."""
        shard = self.sequence_shard
        use_absorbed = cache is not None if absorbed is None else absorbed
        backend = packed_backend(x_BTD.device) if cu_seqlens is not None and not use_absorbed else None
        need_ints = backend == "per_document" or (cu_seqlens is not None and cu_seqlens.device.type == "cpu")
        if cu_seqlens is not None and cu_seqlens_host is None and need_ints:
            cu_seqlens_host = cu_seqlens.tolist()  # this layer's one host read (none on the CUDA flex path)
        self._check_inputs(x_BTD, cu_seqlens, cu_seqlens_host, cache, shard)
        B, t, _ = x_BTD.shape
        q_BTHE = self._query(x_BTD)
        c_kv_BSR, k_r_BSD = self._latent(x_BTD)
        w_kvb, heads = effective_weight(self.kv_b_proj), self.num_heads
        if shard is not None:
            own = head_slice(shard, self.num_heads)
            heads = own.stop - own.start
            q_BTHE = shard.to_head_shard(q_BTHE)  # [B, T, h, E]
            latent_BSC = gather_shared(shard, torch.cat([c_kv_BSR, k_r_BSD], dim=-1))
            c_kv_BSR, k_r_BSD = latent_BSC.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            w_kvb = w_kvb.view(self.num_heads, -1, self.kv_lora_rank)[own].reshape(-1, self.kv_lora_rank)
        T = q_BTHE.shape[1]
        if cache is not None:
            c_kv_BSR, k_r_BSD = cache.append(c_kv_BSR, k_r_BSD)
        if self.track_max_logit:
            got_h = mla_max_logits(
                q_BTHE, c_kv_BSR, k_r_BSD, w_kvb, self.nope_dim, self.scale, cu_seqlens, cu_seqlens_host
            )
            self._record_max_logit(got_h, own if shard is not None else None)
        attend = absorbed_mla_attention if use_absorbed else naive_mla_attention
        args = (w_kvb, heads, self.nope_dim, self.v_dim)
        if backend == "flex":
            assert cu_seqlens is not None  # the backend is chosen for packed rows only
            o_BTHV = flex_mla_attention(q_BTHE, c_kv_BSR, k_r_BSD, *args, cu_seqlens, self.scale)
        elif backend == "per_document":
            # packed documents: one causal call per document selects a fused kernel (CPU flash; CUDA flash or
            # memory-efficient) with no T x T mask, scores or probabilities and the causal work skipped, where a
            # block-diagonal mask forces the math path (and a [T, T] mask at 1M tokens would be 1 TB)
            cu = cu_seqlens_host
            assert cu is not None  # read above whenever the per-document path is taken
            o_BTHV = torch.cat(
                [
                    attend(q_BTHE[:, s:e], c_kv_BSR[:, s:e], k_r_BSD[:, s:e], *args, None, True, self.scale)
                    for s, e in zip(cu, cu[1:])
                    if e > s
                ],
                dim=1,
            )
        else:
            mask_TS, is_causal = attention_mask(T, c_kv_BSR.shape[1], cu_seqlens, x_BTD.device)
            o_BTHV = attend(q_BTHE, c_kv_BSR, k_r_BSD, *args, mask_TS, is_causal, self.scale)
        if shard is not None:
            o_BTHV = shard.to_token_shard(o_BTHV)  # [B, T, h, dv] -> [B, t, H, dv]
        o_BTF = o_BTHV.reshape(B, t, self.num_heads * self.v_dim)
        if self.use_output_gate:  # element-wise, head-specific, query-dependent sigmoid (Gated Attention G1)
            o_BTF = (torch.sigmoid(upcast(self.g_proj(x_BTD))) * upcast(o_BTF)).to(x_BTD.dtype)
        return self.o_proj(o_BTF)

    def _record_max_logit(self, got_h: torch.Tensor, own: slice | None) -> None:
        """Raise `max_logit_H` [H] fp32 to this forward's per-head maxima (heads this rank does not own: -inf)."""
        full_H = torch.full((self.num_heads,), float("-inf"), dtype=torch.float32, device=got_h.device)
        full_H[own if own is not None else slice(None)] = got_h.float()
        self.max_logit_H = full_H if self.max_logit_H is None else torch.maximum(self.max_logit_H, full_H)

    def _check_inputs(
        self,
        x_BTD: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        cu_host: list[int] | None,
        cache: MLACache | None,
        shard: SequenceShard | None,
    ) -> None:
        if x_BTD.dim() != 3 or x_BTD.shape[-1] != self.hidden_size:
            raise ValueError(f"GatedMLA expects x of shape [B, T, {self.hidden_size}], got {tuple(x_BTD.shape)}")
        if shard is not None and cache is not None:
            raise ValueError("GatedMLA: a decode cache cannot be combined with sequence parallelism")
        T = x_BTD.shape[1] * (shard.size if shard is not None else 1)
        if cu_seqlens is None:
            return
        if cache is not None:
            raise ValueError(
                "GatedMLA got both cu_seqlens and cache; decode one sequence batch per cache without cu_seqlens"
            )
        if x_BTD.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens needs batch size 1 (packed documents), got batch {x_BTD.shape[0]}; "
                "flatten the batch into one row"
            )
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            )
        if cu_host is not None:  # value check only on ints the host holds already (no extra device->host read)
            cu = cu_host
            if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens must rise from 0 to T={T} (non-decreasing), got {cu}")

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"dn/dr/dv={self.nope_dim}/{self.rope_dim}/{self.v_dim}, gate={self.use_output_gate}, NoPE"
        )
