"""K3 FLOPs per token: the one formula behind the trainer's MFU and the planner's step-time estimate.

Why a formula and not a profiler: MFU compares *model* FLOPs (what the architecture needs per token) with the
hardware peak, independent of recomputation (activation checkpointing), padding or kernel choice.

Forward FLOPs per token (multiply-accumulate = 2 FLOPs), T = seq_len, summed over layers:
- matmuls: 2 x every weight a token is multiplied with: KDA/MLA projections, the depthwise short convs
  (2 x 3KP), dense FFN, router (all E rows), latent down/up, the k routed experts, shared experts, lm_head.
  Embedding lookups, norms, biases, gates' elementwise maths are excluded.
- MLA attention (causal, un-absorbed training form): QK^T costs 2*H*(d_n+d_r) and PV 2*H*d_v per (query, key)
  pair; a causal sequence has T(T+1)/2 pairs, i.e. (T+1)/2 per token -> H*(d_n+d_r+d_v)*(T+1) per layer.
- KDA chunked core (docs/model.md §3, chunk C, per head, per token): L = (K.D)K^T C*d_k, W,U = M[K|V] C*(d_k+d_v),
  A_qk C*d_k, A_qk V' C*d_v, three state products (W S, Q S, K^T V') 3*d_k*d_v, the unit-lower solve C^2/6 MACs
  -> 2*H*(C*(3*d_k + 2*d_v) + 3*d_k*d_v + C^2/6). Linear in T (no T term).
- Block AttnRes: each depth mixture over N candidates costs 4*N*d (dot products + weighted sum).
Training = 3 x forward (backward = 2 x forward). Recomputation is not counted (MFU, not HFU).
"""

from __future__ import annotations

from model.attn_res import MixtureSizes, attn_res_mixture_sizes
from model.config import K3Config


def _kda_matmul_params(c: K3Config) -> int:
    d, P, H, dk, K = c.hidden_size, c.kda_num_heads * c.kda_head_dim, c.kda_num_heads, c.kda_head_dim, c.kda_conv_size
    gate = d * P if c.kda_use_full_rank_gate else d * dk + dk * P
    # q,k,v + convs + f_a/f_b (decay) + b_proj (beta) + output gate + o_proj
    return 3 * d * P + 3 * K * P + (d * dk + dk * P) + d * H + gate + P * d


def _mla_matmul_params(c: K3Config) -> int:
    d, H = c.hidden_size, c.num_attention_heads
    dn, dr, dv, rkv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    q = d * c.q_lora_rank + c.q_lora_rank * H * (dn + dr) if c.q_lora_rank else d * H * (dn + dr)
    gate = d * H * dv if c.mla_use_output_gate else 0
    return q + d * (rkv + dr) + rkv * H * (dn + dv) + gate + H * dv * d


def _moe_active_matmul_params(c: K3Config) -> int:
    d, E, k = c.hidden_size, c.num_experts, c.num_experts_per_token
    l, Im = c.routed_expert_hidden_size, c.moe_intermediate_size
    return E * d + 2 * d * l + k * 3 * l * Im + 3 * d * c.num_shared_experts * Im


def attn_res_sizes(c: K3Config) -> MixtureSizes:
    """The model's own Block AttnRes mixture sizes (model/attn_res.py): one home for the bookkeeping."""
    return attn_res_mixture_sizes(c.num_hidden_layers, c.attn_res_block_size if c.attn_res_enabled else None)


def flops_breakdown(config: K3Config, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by component (see module docstring); sum = forward FLOPs per token."""
    c = config
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    types = c.layer_types
    n_kda, n_mla = types.count("kda"), types.count("mla")
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    n_dense = c.num_hidden_layers - n_moe
    d = c.hidden_size

    H, dk = c.kda_num_heads, c.kda_head_dim
    C = c.kda_chunk_size
    kda_core = 2.0 * H * (C * (3 * dk + 2 * dk) + 3 * dk * dk + C * C / 6.0)  # d_v = d_k for KDA
    Hm = c.num_attention_heads
    mla_core = float(Hm * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * (seq_len + 1))
    sizes = attn_res_sizes(c)
    attn_res = 4.0 * d * (sum(a + m for a, m in sizes.layers) + sizes.output)
    out = {
        "kda_proj": 2.0 * n_kda * _kda_matmul_params(c),
        "kda_core": n_kda * kda_core,
        "mla_proj": 2.0 * n_mla * _mla_matmul_params(c),
        "mla_attention": n_mla * mla_core,
        "dense_ffn": 2.0 * n_dense * 3 * d * c.intermediate_size,
        "moe": 2.0 * n_moe * _moe_active_matmul_params(c),
        "attn_res": attn_res,
        "lm_head": 2.0 * c.vocab_size * d,
    }
    if c.mtp_depth:  # per MTP block: eh_proj, an MLA + MoE layer and another lm_head (model/mtp.py)
        per = 2.0 * (2 * d * d + _mla_matmul_params(c) + _moe_active_matmul_params(c) + c.vocab_size * d)
        out["mtp"] = c.mtp_depth * (per + mla_core)
    return out


def matmul_params_active(config: K3Config) -> int:
    """Active weights a token is multiplied with (excl. embedding table, norms, biases; incl. lm_head)."""
    c = config
    types = c.layer_types
    n_moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    return (
        types.count("kda") * _kda_matmul_params(c)
        + types.count("mla") * _mla_matmul_params(c)
        + (c.num_hidden_layers - n_moe) * 3 * c.hidden_size * c.intermediate_size
        + n_moe * _moe_active_matmul_params(c)
        + c.vocab_size * c.hidden_size
    )


def flops_per_token(config: K3Config, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token at sequence length seq_len: forward, or x3 for a training step (fwd + bwd)."""
    fwd = sum(flops_breakdown(config, seq_len).values())
    return 3.0 * fwd if training else fwd


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the hardware peak (0 when the peak is unknown)."""
    if peak_flops_per_s <= 0:
        return 0.0
    return tokens_per_s * flops_per_tok / peak_flops_per_s
