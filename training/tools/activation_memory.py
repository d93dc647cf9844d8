"""Activation memory of one micro-batch: the bytes autograd keeps for backward, per component, as formulas.

Why formulas: the planner must answer for the 2.78T model without building it. Each term lists the tensors this
implementation saves (read off the modules, checked against `torch.autograd.graph.saved_tensors_hooks` on tiny
models in tests/training/test_plan.py, within 10%). Counts are elements per token; `A` = activation dtype
(bf16 on GPU, fp32 on CPU), `F` = fp32 internals (norm statistics, gates, SiTU, KDA recurrence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from training.metrics.flops import attn_res_sizes

if TYPE_CHECKING:
    from model.config import K3Config


def _norm(D: int) -> tuple[float, float]:
    """RMSNorm on a fresh tensor: its fp32 input (D), rsqrt (1), pre-weight product (D); output counted by user."""
    return 0.0, 2.0 * D + 1


def mla_elements(c: K3Config, seq_len: int, attention: str) -> tuple[float, float]:
    """(A, F) per token for one GatedMLA layer incl. its input x. attention='math' keeps softmax probs (H*T per
    token, PyTorch's CPU SDPA path), 'flash' keeps only the log-sum-exp (H per token)."""
    d, H = c.hidden_size, c.num_attention_heads
    dn, dr, dv, rq, rkv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank or 0, c.kv_lora_rank
    a = d + 2 * H * (dn + dr) + H * dv  # x; q and k per head; v
    f = 0.0
    if rq:
        _, nf = _norm(rq)
        a, f = a + rq, f + nf  # q_a output -> norm -> q_b input
    _, nf = _norm(rkv)
    a, f = a + rkv + dr, f + nf  # kv_a output (c and k_r), normed c_hat into kv_b
    f += H * seq_len if attention == "math" else H
    if c.mla_use_output_gate:
        a, f = a + 2 * H * dv, f + H * dv  # attention output, gated product into o_proj; sigmoid(g)
    else:
        a += H * dv
    return a, f


def glu_elements(d: int, inter: int, tile_frac: float = 1.0) -> tuple[float, float]:
    """SiTU-GLU FFN: input x (A), product into down_proj (A), six fp32 SiTU/cap intermediates. `tile_frac` < 1
    (`train.ffn_tile_tokens`, model/ffn.py): only one tile of tokens holds the [inter] activations at a time."""
    return d + inter * tile_frac, 6.0 * inter * tile_frac


def moe_elements(c: K3Config, tile_frac: float = 1.0) -> tuple[float, float]:
    """LatentMoE: x, router scores/top-k bookkeeping, latent z and u (+ its norm), shared experts. The routed
    experts recompute their internals in backward (custom autograd), so they keep only z."""
    d, E, k, l = c.hidden_size, c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size
    sa, sf = glu_elements(d, c.num_shared_experts * c.moe_intermediate_size, tile_frac)  # includes x (d)
    _, nf = _norm(l)
    # A: latent z and the normed u into up-proj; F: router scores + top-k/sort bookkeeping, u's norm
    return sa + 2 * l, sf + 3 * E + 6 * k + 1 + nf


def kda_sub_blocks(c: K3Config) -> int:
    """Sub-blocks per chunk the chunked KDA kernel factorises its decayed scores into, for the worst-case decay the
    gate bound allows (|g| <= |gate_lower_bound|; a trained model reaches it): n_s = C / S (model/kda/chunk.py)."""
    import torch

    from model.kda.chunk import sub_block_size

    C, g = c.kda_chunk_size, c.kda_gate_lower_bound
    S = sub_block_size(C, abs(g), torch.float32) if g is not None else 0
    return C // S if S else C  # unbounded gates: the exact [C, C, K] form, C times the memory


def kda_elements(c: K3Config, seq_len: int, mixer_tile: int = 0) -> tuple[float, float]:
    """KDA layer incl. its input x. A: projections, conv in/out (padded by W-1), f_a output, o_proj input.
    F (fp32 inside the kernel): L2 norms, beta, decay, the chunked core (model/kda/chunk.py saves per chunk 9
    [C, K]-sized tensors plus the strips of the sub-block decay factors, 3 block-lower [C, C] matrices whose
    upper blocks are not stored, beta, states S [K, V] at every chunk boundary; the exact form keeps a [C, C, K]
    factor instead), the per-head output norm and gate. Chunk tensors cover the padded length ceil(T/C)*C.
    `mixer_tile` > 0 (train.mixer_tile_tokens, model/kda/tiled.py): the chunk tensors, conv inputs/outputs and L2
    norms of one tile only, plus one boundary state [K, V] per head and tile (the tiles keep the pre-conv q, k, v
    projections, beta and decay, counted here anyway)."""
    d, H, K, C, W = c.hidden_size, c.kda_num_heads, c.kda_head_dim, c.kda_chunk_size, c.kda_conv_size
    P = H * K
    N = -(-seq_len // C)
    pad = N * C / seq_len  # padded tokens per real token
    n_s = kda_sub_blocks(c)
    a = d + 9 * P + 3 * P * (W - 1) / seq_len + K + P
    if n_s == C:  # exact form: the [C, C, K] decay factor, full C x C matrices
        core = (9 + C) * P + 3 * H * C
    else:  # strips below the diagonal sub-blocks; block-lower C x C matrices
        core = (9 + sum(1 - b / n_s for b in range(n_s - 1))) * P + 3 * H * C * (n_s + 1) / (2 * n_s)
    chunk = (core + H) * pad + H * K * K * (N + 1) / seq_len
    if 0 < mixer_tile < seq_len:
        n_tiles = -(-seq_len // mixer_tile)
        chunk = (core + H) + H * K * K * (mixer_tile // C + 1) / mixer_tile  # one tile's share, per tile token
        chunk = chunk * mixer_tile / seq_len + H * K * K * n_tiles / seq_len
    f = 2 * (P + H) + H + 2 * P + chunk + (2 * P * pad + H) + 2 * P
    if 0 < mixer_tile < seq_len:  # the conv inputs (padded) and outputs, and the L2 norms, live in one tile too
        keep = 1 - mixer_tile / seq_len
        a -= (6 * P + 3 * P * (W - 1) / seq_len) * keep
        f -= 2 * (P + H) * keep
    return a, f


def attn_res_elements(n_candidates: int) -> float:
    """One depth mixture: per candidate rms, logit, softmax weight (+1): candidates themselves are live anyway."""
    return 4.0 * n_candidates if n_candidates else 0.0


def activation_elements(
    c: K3Config,
    seq_len: int,
    attention: str = "flash",
    tile_frac: float = 1.0,
    loss_tiled: bool = False,
    mixer_tile: int = 0,
) -> dict[str, tuple[float, float]]:
    """(A, F) elements per token by component, without activation checkpointing; `tile_frac`: the FFN tiling's
    share of tokens holding intermediates, `loss_tiled`: no logits kept (model/loss.py), `mixer_tile`: the KDA
    core's tile (model/kda/tiled.py)."""
    d = c.hidden_size
    types = c.layer_types
    comp: dict[str, list[float]] = {
        k: [0.0, 0.0] for k in ("embedding", "kda", "mla", "dense_ffn", "moe", "norms_residual", "head_loss")
    }
    comp["embedding"][0] += d

    def add(name: str, af: tuple[float, float]) -> None:
        comp[name][0] += af[0]
        comp[name][1] += af[1]

    sizes = attn_res_sizes(c)
    for i in range(c.num_hidden_layers):
        add(
            "kda" if types[i] == "kda" else "mla",
            kda_elements(c, seq_len, mixer_tile) if types[i] == "kda" else mla_elements(c, seq_len, attention),
        )
        add(
            "moe" if c.is_moe_layer(i) else "dense_ffn",
            moe_elements(c, tile_frac) if c.is_moe_layer(i) else glu_elements(d, c.intermediate_size, tile_frac),
        )
        n_attn, n_mlp = sizes.layers[i]
        # mixer input (mix output or residual), two norms, partial sums after each sublayer, mlp mix output
        a = (d if (i > 0 or not c.attn_res_enabled) else 0) + 2 * d + (d if c.attn_res_enabled else 0)
        add("norms_residual", (a, 2 * (d + 1) + attn_res_elements(n_attn) + attn_res_elements(n_mlp)))
    n_out = sizes.output
    # output mix + final norm + normed hidden into lm_head + logits kept by the loss + per-token lse/target
    logits = 0 if loss_tiled else c.vocab_size
    add("head_loss", (d * (1 if c.attn_res_enabled else 0) + d + logits, d + 1 + attn_res_elements(n_out) + 3))
    return {k: (v[0], v[1]) for k, v in comp.items()}


def loss_backward_bytes(
    c: K3Config, micro_batch: int, seq_len: int, act_bytes: int = 2, sp_size: int = 1, loss_tile: int = 0
) -> float:
    """Transient bytes of the loss backward, the first thing backward runs, while every activation is still live:
    the logits gradient (activation dtype, [tokens, V]) plus one fp32 chunk of recomputed softmax (model/k3.py's
    chunked cross-entropy: at most `_ce_chunk_rows(V)` rows at a time). Tiled (`loss_tile` tokens, model/loss.py):
    the hidden-state gradient, the lm_head weight gradient (accumulated in place) and one tile's logits, their
    fp32 upcast (bf16) and fp32 softmax."""
    from model.k3 import _ce_chunk_rows

    tokens = micro_batch * seq_len // sp_size
    V, d = c.vocab_size, c.hidden_size
    if loss_tile > 0:
        tile = min(tokens, loss_tile) * V * (8.0 + (act_bytes if act_bytes < 4 else 0))
        return (tokens + V) * d * act_bytes + tile
    return tokens * V * act_bytes + min(tokens, _ce_chunk_rows(V)) * V * 4.0


def sequence_parallel_extra(c: K3Config, sp_size: int) -> tuple[float, float]:
    """(A, F) more per local token under Ulysses SP (model/sequence.py): each MLA layer keeps the head-shared
    latent [c_hat ; k_r] gathered from all sp_size shards (what its per-head keys/values are computed from) where one
    rank keeps only its own. Everything else moves between layouts of the same size: per-token elements are the
    SP=1 ones at the whole sequence's length (a rank holds T/N tokens x H heads or T tokens x H/N heads)."""
    n_mla = sum(t != "kda" for t in c.layer_types)
    return n_mla * (sp_size - 1) * (c.kv_lora_rank + c.qk_rope_head_dim), 0.0


def activation_bytes(
    c: K3Config,
    micro_batch: int,
    seq_len: int,
    act_bytes: int = 2,
    checkpointing: bool = False,
    attention: str = "flash",
    sp_size: int = 1,
    ffn_tile: int = 0,
    loss_tile: int = 0,
    offload: bool = False,
    mixer_tile: int = 0,
) -> dict[str, float]:
    """Bytes kept for backward by one micro-batch [micro_batch, seq_len], by component, plus `total`; with
    `sp_size` > 1 one sequence-parallel rank's share (its micro_batch * seq_len / sp_size tokens). `ffn_tile`,
    `loss_tile`: train.ffn_tile_tokens / loss_tile_tokens; `offload` (train.activation_offload, with
    checkpointing): the layer inputs live in host memory, reported as `host_layer_inputs` outside `total`;
    `mixer_tile`: train.mixer_tile_tokens (the KDA core over recomputed tiles).

    With per-decoder-layer checkpointing only each layer's inputs stay (the new partial sum, d per token per layer;
    completed AttnRes blocks are shared) plus embedding and head/loss, and backward recomputes one layer at a time:
    + the largest single layer's activations.
    """
    tokens = micro_batch * seq_len / sp_size
    frac = min(1.0, ffn_tile / tokens) if ffn_tile > 0 else 1.0
    el = activation_elements(c, seq_len, attention, frac, loss_tile > 0, mixer_tile)
    if sp_size > 1:
        el["sequence_parallel"] = sequence_parallel_extra(c, sp_size)
    b = {k: tokens * (a * act_bytes + f * 4) for k, (a, f) in el.items()}
    if checkpointing:
        L = c.num_hidden_layers
        per_layer = []
        for i, kind in enumerate(c.layer_types):
            mix = kda_elements(c, seq_len, mixer_tile) if kind == "kda" else mla_elements(c, seq_len, attention)
            ffn = moe_elements(c, frac) if c.is_moe_layer(i) else glu_elements(c.hidden_size, c.intermediate_size, frac)
            per_layer.append(tokens * ((mix[0] + ffn[0]) * act_bytes + (mix[1] + ffn[1]) * 4))
        kept = {
            "embedding": b["embedding"],
            "head_loss": b["head_loss"],
            "layer_inputs": tokens * L * c.hidden_size * act_bytes,
            "recompute_peak": max(per_layer) + b["norms_residual"] / max(L, 1),
        }
        b = kept
    b["total"] = sum(b.values())
    if checkpointing and offload:
        b["host_layer_inputs"] = b.pop("layer_inputs")
        b["total"] -= b["host_layer_inputs"]
    return b
