"""A micro K3 config shared by the model tests: every layer kind, block AttnRes with a partial block, seconds to run."""

from __future__ import annotations

import torch

from model.config import K3Config


def micro_config(**overrides) -> K3Config:
    """5 layers (KDA x3, MLA at 4 and 5), d = 32, 4 experts top-2 + 1 shared, AttnRes blocks of 2, chunk 16."""
    base = dict(
        vocab_size=61,
        hidden_size=32,
        num_hidden_layers=5,
        intermediate_size=64,
        linear_attn_config=dict(num_heads=2, head_dim=16),
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=16,
        routed_expert_hidden_size=16,
        attn_res_block_size=2,
        kda_chunk_size=16,
    )
    base.update(overrides)
    return K3Config(**base)


@torch.no_grad()
def exercise_every_path(model: torch.nn.Module) -> torch.nn.Module:
    """Non-zero AttnRes pseudo-queries and router biases (both zero at init), so every path mixes and routes."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("_res_proj.weight"):
            t.normal_()
        elif name.endswith("e_score_correction_bias"):
            t.normal_(std=0.05)
    return model
