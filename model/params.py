"""Parameter counts from the real modules, built on the meta device (no memory, even for the 2.78T config).

Conventions (docs/model.md §8): `A_log` counts H per KDA layer (the module holds it unpadded); "active" excludes
the input embedding table and the E - k routed experts a token does not use, with the per-expert size read from
the real stacked expert tensors. "Parameters" are the checkpoint tensors, i.e. the persistent state: trainable
parameters plus the router's `e_score_correction_bias` buffer (docs/model.md §8 counts it: router = E*d + E).
"""

from __future__ import annotations

from collections import defaultdict

from model.config import K3Config
from model.meta import on_meta


def build_meta(config: K3Config):
    """`K3ForCausalLM(config)` on the meta device."""
    from model.k3 import K3ForCausalLM  # local import: model.k3 pulls in every mixer

    with on_meta():
        return K3ForCausalLM(config)


def count_vision_params(config: K3Config) -> tuple[int, int]:
    """(vision tower, projector) parameters of `config.vision_config`, built on the meta device; (0, 0) text-only.
    The tower holds no buffers: every count is a checkpoint tensor (`vision_tower.*` / `mm_projector.*`)."""
    if config.vision_config is None:
        return 0, 0
    from model.vision.tower import MoonViT, PatchMergerV2  # local import, as build_meta

    with on_meta():
        tower, proj = MoonViT(config.vision_config), PatchMergerV2(config.vision_config)
    return (
        int(sum(t.numel() for t in tower.state_dict().values())),
        int(sum(t.numel() for t in proj.state_dict().values())),
    )


def _expert_numel(moe) -> int:
    """Parameters of one routed expert, from the stacked tensors `experts.w{1,2,3} [E_local, ...]`."""
    ex = moe.experts
    return sum(int(getattr(ex, n)[0].numel()) for n in ("w1", "w2", "w3"))


def count_params(config: K3Config, model=None) -> tuple[int, int]:
    """(total, active excl. input embedding) for `config` (or an already built `model`)."""
    model = build_meta(config) if model is None else model
    total = sum(t.numel() for t in model.state_dict().values())
    emb = model.model.embed_tokens.weight.numel()
    k, E = config.num_experts_per_token, config.num_experts
    inactive = sum((E - k) * _expert_numel(moe) for moe in model.moe_layers())
    return int(total), int(total - emb - inactive)


def _component(name: str, layer_types: list[str]) -> str:
    """Map a parameter name to a breakdown bucket."""
    if name.startswith("lm_head."):
        return "lm_head"
    if name.startswith("model.embed_tokens."):
        return "embedding"
    if not name.startswith("model.layers."):
        return "final_norm_attn_res"  # model.norm, model.output_attn_res_*
    i = int(name.split(".")[2])
    rest = name.split(".", 3)[3]
    if rest.startswith("self_attn."):
        return layer_types[i] if i < len(layer_types) else "mla"  # kda | mla (MTP blocks: MLA)
    if rest.startswith("mlp."):
        return "dense_ffn"
    if rest.startswith("block_sparse_moe."):
        sub = rest.split(".")[1]
        return {"experts": "moe_routed_experts", "shared_experts": "moe_shared_experts", "gate": "moe_router"}.get(
            sub, "moe_latent_proj_norm"
        )
    return "layer_norms_attn_res"


def param_breakdown(config: K3Config, model=None) -> dict[str, int]:
    """Total parameters per component (embedding, lm_head, kda, mla, dense_ffn, moe_router, moe_routed_experts,
    moe_shared_experts, moe_latent_proj_norm, layer_norms_attn_res, final_norm_attn_res) plus `total`, `active`,
    `active_incl_embedding`, `per_routed_expert` and per-layer-kind sizes (`kda_layer`, `mla_layer`,
    `moe_layer`, `moe_layer_active`, `dense_ffn_layer`) for planners."""
    model = build_meta(config) if model is None else model
    types = config.layer_types
    out: dict[str, int] = defaultdict(int)
    for name, t in model.state_dict().items():
        out[_component(name, types)] += t.numel()
    total, active = count_params(config, model)
    out.update(total=total, active=active, active_incl_embedding=active + config.vocab_size * config.hidden_size)
    layers = model.model.layers
    for kind in ("kda", "mla"):
        first = next((l for l in layers if l.layer_type == kind), None)
        out[f"{kind}_layer"] = sum(p.numel() for p in first.self_attn.parameters()) if first is not None else 0
    moes = model.moe_layers()
    if moes:
        exp = _expert_numel(moes[0])
        moe_tot = sum(t.numel() for t in moes[0].state_dict().values())
        out.update(
            per_routed_expert=exp,
            moe_layer=moe_tot,
            moe_layer_active=moe_tot - (config.num_experts - config.num_experts_per_token) * exp,
        )
    dense = next((l for l in layers if not l.is_moe), None)
    out["dense_ffn_layer"] = sum(p.numel() for p in dense.mlp.parameters()) if dense is not None else 0
    return {k: int(v) for k, v in out.items()}
