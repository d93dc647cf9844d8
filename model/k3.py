"""The K3 language model: decoder layers (KDA | gated MLA mixer, dense | latent-MoE FFN) joined by Block AttnRes.

Module paths are the HF text-only key spelling (docs/model.md §12), so `state_dict()` is the checkpoint up to two
documented exceptions handled in `model/hf.py`: routed experts are stacked tensors (`experts.w1 [E, Im, l]`) and
`A_log` is unpadded `[H]`.

Residual stream (docs/model.md §2, §6): with `attn_res_block_size` set, every sublayer input is a softmax-over-depth mix
of the embedding, the completed block sums and the running partial sum; with it 0/None, the plain PreNorm stack
`h = h + mixer(norm(h)); h = h + ffn(norm(h))`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.attn_res import attn_res_mix
from model.config import K3Config
from model.ffn import SiTUGLU
from model.kda import KDA, KDACache
from model.loss import IGNORE_INDEX, LMHead
from model.mla import GatedMLA, MLACache
from model.moe.grouped import resolve_backend
from model.moe.layer import LatentMoE
from model.mtp import add_mtp_inputs, mtp_losses
from model.norm import RMSNorm, upcast
from model.offload import HostCopies, checkpoint_on_host
from model.sequence import SequenceShard


@dataclass
class K3Output:
    logits: torch.Tensor | None  # [B, T, V] in the model dtype; None when the loss was tiled (set_loss_tiling)
    loss: torch.Tensor | None = None  # mean next-token CE over counted targets (+ aux_loss when moe_balance == aux)
    router_stats: list = field(default_factory=list)  # one RouterStats per MoE layer, in layer order
    aux_loss: torch.Tensor | None = None  # sum of the MoE layers' auxiliary losses (moe_balance == aux), else None
    num_loss_tokens: torch.Tensor | None = None  # how many targets the CE averaged over (int64 scalar)
    mtp_losses: list | None = None  # per MTP depth its mean CE (model/mtp.py); `loss` holds mtp_loss on top
    mtp_loss: torch.Tensor | None = None  # mtp_weight x mean of mtp_losses, included in `loss`
    mtp_counts: list | None = None  # per MTP depth the targets its CE averaged over
    hidden_states: torch.Tensor | None = None  # [B, T, D] final-normed hidden state (MTP drafting reads it)


@dataclass
class K3Cache:
    """Decode state of the whole model: one KDACache / MLACache per layer, mutated in place by forward."""

    layers: list
    seen_tokens: int = 0

    @classmethod
    def empty(cls, config: K3Config) -> K3Cache:
        n = config.num_hidden_layers + config.mtp_depth  # the MTP blocks (MLA) cache too: self-speculative decode
        return cls([KDACache() if config.layer_kind(i) == "kda" else MLACache() for i in range(n)])


# --- loss -------------------------------------------------------------------------------------------------------


def _ce_chunk_rows(vocab_size: int) -> int:
    """Rows per CE chunk so one fp32 chunk of logits stays around 64 Mi elements (256 MiB)."""
    return max(1, (1 << 26) // vocab_size)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Sum of CE over rows with targets != -100, in >= fp32, holding at most one fp32 chunk of logits at a time.

    Saves only the logits (whatever dtype), the targets and the per-row logsumexp; the backward recomputes the
    softmax chunk by chunk, so no full fp32 copy of the logits is ever kept besides the gradient itself.
    """

    @staticmethod
    def forward(ctx, logits_ND: torch.Tensor, targets_N: torch.Tensor, rows: int) -> torch.Tensor:
        N = logits_ND.shape[0]
        acc_dtype = upcast(logits_ND[:0]).dtype
        lse_N = torch.empty(N, dtype=acc_dtype, device=logits_ND.device)
        total = torch.zeros((), dtype=acc_dtype, device=logits_ND.device)
        for s in range(0, N, rows):
            l_CD = upcast(logits_ND[s : s + rows])
            t_C = targets_N[s : s + rows]
            lse_C = torch.logsumexp(l_CD, dim=-1)
            tgt_C = l_CD.gather(-1, t_C.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            total = total + torch.where(t_C != IGNORE_INDEX, lse_C - tgt_C, 0.0).sum()
            lse_N[s : s + rows] = lse_C
        ctx.save_for_backward(logits_ND, targets_N, lse_N)
        ctx.rows = rows
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits_ND, targets_N, lse_N = ctx.saved_tensors
        grad_ND = torch.empty_like(logits_ND)
        rows = ctx.rows
        for s in range(0, logits_ND.shape[0], rows):
            t_C = targets_N[s : s + rows]
            # softmax, exponentiated in place: one fp32 chunk is the only transient besides the gradient
            p_CD = (upcast(logits_ND[s : s + rows]) - lse_N[s : s + rows].unsqueeze(-1)).exp_()
            valid_C = t_C != IGNORE_INDEX
            p_CD.scatter_add_(
                -1, t_C.clamp_min(0).unsqueeze(-1), -valid_C.to(p_CD.dtype).unsqueeze(-1)
            )  # minus one-hot at the target
            p_CD.mul_((valid_C.to(p_CD.dtype) * grad_out).unsqueeze(-1))
            grad_ND[s : s + rows] = p_CD.to(grad_ND.dtype)
        return grad_ND, None, None


def shift_targets(labels_BT: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """HF convention: position t predicts labels[t + 1]; the last position and, with packed documents, the last
    position of every document (whose next token starts another document) get -100."""
    targets = torch.full_like(labels_BT, IGNORE_INDEX)
    targets[:, :-1] = labels_BT[:, 1:]
    if cu_seqlens is not None:
        ends = cu_seqlens[1:].to(torch.long) - 1
        targets[:, ends[ends >= 0]] = IGNORE_INDEX
    return targets


def causal_lm_loss(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    targets_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token CE in >= fp32, number of counted targets), from labels (shifted here) or from targets
    already shifted (`shift_targets` of the whole sequence, sliced: sequence parallelism)."""
    if targets_BT is None:
        if labels_BT is None:
            raise ValueError("causal_lm_loss needs labels or targets")
        targets_BT = shift_targets(labels_BT, cu_seqlens)
    targets_N = targets_BT.reshape(-1)
    logits_NV = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    total = _ChunkedCrossEntropy.apply(logits_NV, targets_N, _ce_chunk_rows(logits_NV.shape[-1]))
    count = (targets_N != IGNORE_INDEX).sum()
    return total / count.clamp_min(1), count


# --- layers -----------------------------------------------------------------------------------------------------


class K3DecoderLayer(nn.Module):
    """One decoder layer: `input_layernorm -> self_attn (KDA | GatedMLA)`, `post_attention_layernorm -> mlp (dense
    SiTU-GLU) | block_sparse_moe (LatentMoE)`, plus the layer's two AttnRes pseudo-queries and key norms."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.layer_type = config.layer_kind(layer_idx)
        self.is_mtp = layer_idx >= config.num_hidden_layers  # an MTP block (model/mtp.py): plain PreNorm
        self.attn_res_block_size = 0 if self.is_mtp else config.attn_res_block_size or 0
        self.is_moe = config.is_moe_layer(layer_idx)
        self.gradient_checkpointing = False
        self.checkpoint_offload = False  # checkpointed inputs in host memory (model/offload.py)

        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = KDA(config, layer_idx) if self.layer_type == "kda" else GatedMLA(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(config, layer_idx)
        else:
            self.mlp = SiTUGLU(d, config.intermediate_size, config)
        if self.attn_res_block_size:
            # pseudo-queries as Linear(d, 1).weight [1, d] and key norms, under their HF names
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)
        if self.is_mtp:
            add_mtp_inputs(self, d, eps, config.initializer_range)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Own parameters only (the mixer/FFN init themselves): norms 1, pseudo-queries 0 (uniform mixing)."""
        for norm in (self.input_layernorm, self.post_attention_layernorm):
            norm.reset_parameters()
        if self.attn_res_block_size:
            nn.init.zeros_(self.self_attention_res_proj.weight)
            nn.init.zeros_(self.mlp_res_proj.weight)
            self.self_attention_res_norm.reset_parameters()
            self.mlp_res_norm.reset_parameters()

    def _ffn(self, x_BTD: torch.Tensor):
        if self.is_moe:
            return self.block_sparse_moe(x_BTD)
        return self.mlp(x_BTD), None

    def _mix(self, candidates: list[torch.Tensor], proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
        return attn_res_mix(candidates, proj.weight[0], norm.weight, norm.eps)

    def _attn(self, x_BTD: torch.Tensor, cu_seqlens, cache, cu_seqlens_host: list[int] | None) -> torch.Tensor:
        """The mixer (KDA or GatedMLA); packed documents come with their boundaries on the host, read once per
        micro-batch by K3ForCausalLM.forward, so no mixer reads `cu_seqlens` itself."""
        if cu_seqlens is not None:
            return self.self_attn(x_BTD, cu_seqlens=cu_seqlens, cache=cache, cu_seqlens_host=cu_seqlens_host)
        return self.self_attn(x_BTD, cu_seqlens=cu_seqlens, cache=cache)

    def _forward(
        self,
        blocks: list[torch.Tensor],
        partial: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        cache,
        cu_seqlens_host: list[int] | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor, object]:
        if not self.attn_res_block_size:  # plain PreNorm residual stack; `partial` is the residual stream h
            h = partial + self._attn(self.input_layernorm(partial), cu_seqlens, cache, cu_seqlens_host)
            y, stats = self._ffn(self.post_attention_layernorm(h))
            return blocks, h + y, stats
        # Block AttnRes, docs/model.md §6 (never mutates the caller's list: recomputation under checkpointing
        # re-runs this)
        h_in = (
            partial
            if not blocks
            else self._mix(blocks + [partial], self.self_attention_res_proj, self.self_attention_res_norm)
        )
        a = self._attn(self.input_layernorm(h_in), cu_seqlens, cache, cu_seqlens_host)
        if self.layer_idx % self.attn_res_block_size == 0:  # close the block (layer 0 closes b_0 = embedding)
            blocks, partial = blocks + [partial], a
        else:
            partial = partial + a
        m_in = self._mix(blocks + [partial], self.mlp_res_proj, self.mlp_res_norm)
        y, stats = self._ffn(self.post_attention_layernorm(m_in))
        return blocks, partial + y, stats

    def forward(
        self,
        blocks: list[torch.Tensor],
        partial: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
        host_copies: HostCopies | None = None,
        cu_seqlens_host: list[int] | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor, object]:
        """(completed blocks, partial sum) -> updated (blocks, partial, RouterStats | None).

        Under activation checkpointing the backward re-runs `_forward`; its RouterStats are simply discarded,
        so the routing of a micro-batch is counted once. `host_copies`: the forward's shared host copies when
        the checkpoints are offloaded (`checkpoint_offload`)."""
        fwd = functools.partial(self._forward, cu_seqlens_host=cu_seqlens_host)
        if self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled():
            if self.checkpoint_offload:
                copies = host_copies if host_copies is not None else {}
                return checkpoint_on_host(fwd, blocks, partial, cu_seqlens, copies)
            return checkpoint(fwd, blocks, partial, cu_seqlens, None, use_reentrant=False)
        return fwd(blocks, partial, cu_seqlens, cache)


class K3Model(nn.Module):
    """Embedding, decoder layers, output AttnRes and final norm; returns the final normed hidden state."""

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        d = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        n = config.num_hidden_layers + config.mtp_depth  # the MTP blocks follow (DeepSeek-V3's HF indices)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(n))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.attn_res_enabled:
            self.output_attn_res_proj = nn.Linear(d, 1, bias=False)
            self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Embedding N(0, initializer_range) with the padding row zeroed (docs/model.md §7); output query 0, norms 1."""
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=self.config.initializer_range)
        pad = self.config.pad_token_id
        if pad is not None:
            with torch.no_grad():
                self.embed_tokens.weight[pad].zero_()
        self.norm.reset_parameters()
        if self.config.attn_res_enabled:
            nn.init.zeros_(self.output_attn_res_proj.weight)
            self.output_attn_res_norm.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cu_seqlens_host: list[int] | None = None,
    ) -> tuple[torch.Tensor, list]:
        """`inputs_embeds` [B, T, D] replaces the embedding lookup (images scattered in: model/vision);
        `cu_seqlens_host`: cu_seqlens as Python ints (K3ForCausalLM.forward reads them once), for every mixer."""
        blocks: list[torch.Tensor] = []
        partial = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, D]
        stats = []
        copies: HostCopies = {}  # host copies of offloaded checkpoint inputs, shared by this forward's layers
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            layer_cache = None if cache is None else cache.layers[i]
            blocks, partial, s = layer(
                blocks, partial, cu_seqlens, layer_cache, host_copies=copies, cu_seqlens_host=cu_seqlens_host
            )
            if s is not None:
                stats.append(s)
        if self.config.attn_res_enabled:
            partial = attn_res_mix(
                blocks + [partial],
                self.output_attn_res_proj.weight[0],
                self.output_attn_res_norm.weight,
                self.output_attn_res_norm.eps,
            )
        return self.norm(partial), stats


class K3ForCausalLM(nn.Module):
    """K3 text LM: `model` (K3Model) + untied `lm_head`. See the module docstring for the checkpoint mapping."""

    mtp_weight: float = 0.3  # loss = main + mtp_weight x mean of the MTP depths' CE (train.mtp_weight)

    def __init__(self, config: K3Config) -> None:
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.sequence_shard: SequenceShard | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=self.config.initializer_range)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter per docs/model.md (e.g. after `to_empty` from the meta device): each
        module's `reset_parameters`, children before parents so a module's own init wins over PyTorch defaults."""
        for m in reversed(list(self.modules())):
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()

    # --- API used by training ----------------------------------------------------------------------------------
    def decoder_layers(self) -> list[K3DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, K3DecoderLayer)]

    def moe_layers(self) -> list[nn.Module]:
        return [layer.block_sparse_moe for layer in self.decoder_layers() if layer.is_moe]

    def set_sequence_shard(self, shard: SequenceShard | None) -> None:
        """Split every sequence over ranks (model/sequence.py): forward then takes this rank's tokens, the whole
        sequence's cu_seqlens and `targets` instead of labels; every mixer sees its head group of all tokens."""
        self.sequence_shard = shard
        for layer in self.decoder_layers():
            layer.self_attn.sequence_shard = shard

    def set_loss_tiling(self, tokens: int) -> None:
        """`tokens` > 0: a forward with labels/targets computes the loss `tokens` logits rows at a time and never
        materialises [T, V] logits (model/loss.py; `K3Output.logits` is then None); 0: full logits."""
        if tokens < 0:
            raise ValueError(f"loss tiling needs tokens >= 0 (0 = off), got {tokens}")
        self.lm_head.tile_rows = int(tokens)

    def set_ffn_tiling(self, tokens: int) -> None:
        """`tokens` > 0: the dense FFNs and shared experts recompute over sequence tiles of `tokens` in backward
        (SiTUGLU.tile_rows); the routed experts already keep only their latent input and recompute block by
        block (model/moe/dispatch.py). 0: off."""
        if tokens < 0:
            raise ValueError(f"FFN tiling needs tokens >= 0 (0 = off), got {tokens}")
        for m in self.modules():
            if isinstance(m, SiTUGLU):
                m.tile_rows = int(tokens)

    def set_expert_backend(self, name: str) -> None:
        """Routed-expert GEMMs: `grouped_mm` (one torch.nn.functional.grouped_mm per weight, offsets on the device,
        no host sync), `loop` (per-expert GEMMs over host counts, the CPU's fastest), `auto` (grouped_mm on CUDA,
        loop on CPU). A runtime choice (Hydra `model.expert_backend`), not part of the model's config.json."""
        resolve_backend(name, torch.device("cpu"))  # validates the name
        for m in self.modules():
            if isinstance(m, LatentMoE) and hasattr(m.dispatcher, "backend"):
                m.dispatcher.backend = name

    def set_mixer_tiling(self, tokens: int) -> None:
        """`tokens` > 0: every KDA mixer runs its chunked core over tiles of `tokens` (a multiple of the chunk size),
        each recomputed on its own in backward (model/kda/tiled.py); 0: off."""
        C = self.config.kda_chunk_size
        if tokens < 0 or tokens % C:
            raise ValueError(f"mixer tiling needs tokens >= 0 and a multiple of kda_chunk_size={C}, got {tokens}")
        for m in self.modules():
            if isinstance(m, KDA):
                m.tile_tokens = int(tokens)

    def set_gradient_checkpointing(self, enabled: bool = True, offload: bool = False) -> None:
        """Checkpoint every decoder layer; `offload`: its saved inputs in host memory (model/offload.py)."""
        for layer in self.decoder_layers():
            layer.gradient_checkpointing = enabled
            layer.checkpoint_offload = bool(enabled and offload)

    # --- forward -----------------------------------------------------------------------------------------------
    def _check_inputs(self, input_ids, labels, cu_seqlens, cache, targets, cu_host=None) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"input_ids must be an int64 tensor [batch, seq], got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}; add a batch dim with input_ids[None]"
            )
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have the shape of input_ids "
                f"{tuple(input_ids.shape)} (HF convention: the model shifts them)"
            )
        if labels is not None and targets is not None:
            raise ValueError("pass labels (shifted by the model) or targets (already shifted), not both")
        if targets is not None and targets.shape != input_ids.shape:
            raise ValueError(
                f"targets {tuple(targets.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
            )
        shard = self.sequence_shard
        if shard is not None and labels is not None:
            raise ValueError(
                "a sequence-sharded model takes targets, not labels: shift_targets on the whole sequence, then slice"
            )
        T = input_ids.shape[1] * (shard.size if shard is not None else 1)
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(
                    f"cu_seqlens needs batch size 1 (packed documents), got batch {input_ids.shape[0]}; "
                    "flatten the batch into one row"
                )
            if cu_seqlens.dim() != 1 or cu_host[0] != 0 or cu_host[-1] != T:
                raise ValueError(f"cu_seqlens must be 1-D [0, ..., T={T}], got {cu_host}")
            if cache is not None:
                raise ValueError("cu_seqlens and cache cannot be combined; decode one document at a time")

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        targets: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
    ) -> K3Output:
        """`labels` (HF: shifted here) or `targets` (position t's next-token id, -100 = not counted) give the
        loss; under `set_sequence_shard` input_ids/targets are this rank's slice, cu_seqlens the whole sequence's.
        `inputs_embeds` (the embedded input_ids with image features scattered in) replaces the lookup.
        `cu_seqlens_cpu`: cu_seqlens' host copy where the caller has one (the data loader's): then nothing is read
        from the device; else cu_seqlens is read once here, and every mixer gets the Python ints."""
        cu_host = None
        if cu_seqlens is not None:  # the one host read of the boundaries per micro-batch (docs/performance.md)
            cu_host = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        self._check_inputs(input_ids, labels, cu_seqlens, cache, targets, cu_host)
        wants_loss = labels is not None or targets is not None
        mtp = self.config.mtp_depth > 0 and wants_loss
        if mtp and inputs_embeds is None:  # the same lookup K3Model makes; the MTP depths reuse it
            inputs_embeds = self.model.embed_tokens(input_ids)
        hidden_BTD, stats = self.model(
            input_ids, cu_seqlens=cu_seqlens, cache=cache, inputs_embeds=inputs_embeds, cu_seqlens_host=cu_host
        )
        if cache is not None:
            cache.seen_tokens += input_ids.shape[1]
        loss = count = logits_BTV = mtp_loss = per_depth = counts = None
        if wants_loss:
            targets_BT = targets if targets is not None else shift_targets(labels, cu_seqlens)  # type: ignore[arg-type]
            loss, count, logits_BTV = self.lm_loss(hidden_BTD, targets_BT)
            if mtp:
                depths, mtp_stats = mtp_losses(self, hidden_BTD, inputs_embeds, targets_BT, cu_seqlens, cu_host)
                stats = stats + mtp_stats
                per_depth, counts = [d for d, _ in depths], [c for _, c in depths]
                mtp_loss = self.mtp_weight * torch.stack(per_depth).mean()
                loss = loss + mtp_loss
        else:
            logits_BTV = self.lm_head(hidden_BTD)
        aux = [s.aux_loss for s in stats if getattr(s, "aux_loss", None) is not None]
        aux_loss = torch.stack([upcast(a) for a in aux]).sum() if aux else None
        if loss is not None and aux_loss is not None and self.config.moe_balance == "aux":
            loss = loss + aux_loss
        return K3Output(logits_BTV, loss, stats, aux_loss, count, per_depth, mtp_loss, counts, hidden_BTD)

    def lm_loss(self, hidden_BTD: torch.Tensor, targets_BT: torch.Tensor):
        """(mean CE over counted targets, count, logits | None when tiled) of final-normed hidden states."""
        if self.lm_head.tile_rows > 0:  # tiled logits + CE: no [T, V] tensor (model/loss.py)
            count = (targets_BT != IGNORE_INDEX).sum()
            return self.lm_head(hidden_BTD, targets_BT) / count.clamp_min(1), count, None
        logits_BTV = self.lm_head(hidden_BTD)
        loss, count = causal_lm_loss(logits_BTV, None, targets_BT=targets_BT)
        return loss, count, logits_BTV
