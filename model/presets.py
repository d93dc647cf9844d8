"""The model presets (`K3Config.preset`) and the derived 3:1 KDA/MLA schedule; split from model/config.py.

`tiny` (CPU smoke, ~10M), `small` (one GPU, ~274M) and `k3` (the released dims, 2.78T). Vision: `k3` carries the
released MoonViT-V2 tower (the release is multimodal); `tiny`/`small` have a small tower that
`K3Config.preset(name, vision_config=True)` switches on (text-only by default, so every text job stays as it was).
"""

from __future__ import annotations

from typing import Any

from model.vision.config import VisionConfig, small_vision


def k3_schedule(num_layers: int) -> tuple[list[int], list[int]]:
    """(kda_layers, full_attn_layers), 1-indexed: MLA iff l % 4 == 0 or l == L (docs/model.md §1), KDA otherwise."""
    mla = [l for l in range(1, num_layers + 1) if l % 4 == 0 or l == num_layers]
    kda = [l for l in range(1, num_layers + 1) if l not in mla]
    return kda, mla


def _k3_released() -> dict[str, Any]:
    kda, mla = k3_schedule(93)
    return dict(
        vocab_size=163_840,
        hidden_size=7168,
        num_hidden_layers=93,
        intermediate_size=33_792,
        first_k_dense_replace=1,
        rms_norm_eps=1e-5,
        bos_token_id=163_584,
        eos_token_id=163_586,
        pad_token_id=163_839,
        linear_attn_config=dict(
            kda_layers=kda,
            full_attn_layers=mla,
            num_heads=96,
            head_dim=128,
            short_conv_kernel_size=4,
            gate_lower_bound=-5.0,
            use_full_rank_gate=True,
        ),
        num_attention_heads=96,
        num_key_value_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=896,
        num_experts_per_token=16,
        num_shared_experts=2,
        moe_intermediate_size=3072,
        routed_expert_hidden_size=3584,
        routed_scaling_factor=1.0,
        attn_res_block_size=12,
        moe_balance_estimator="histogram",
    )


_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=8,
        intermediate_size=1024,
        linear_attn_config=dict(
            num_heads=4, head_dim=64, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True
        ),
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=128,
        routed_expert_hidden_size=128,
        attn_res_block_size=3,
    ),
    "small": dict(
        vocab_size=32_768,
        hidden_size=768,
        num_hidden_layers=16,
        intermediate_size=3072,
        linear_attn_config=dict(
            num_heads=6, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True
        ),
        num_attention_heads=6,
        num_key_value_heads=6,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_experts=32,
        num_experts_per_token=4,
        num_shared_experts=2,
        moe_intermediate_size=256,
        routed_expert_hidden_size=384,
        attn_res_block_size=2,
    ),
    "k3": _k3_released(),
}


def preset_vision(name: str, hidden_size: int) -> VisionConfig:
    """The tower preset `name` gets with `vision_config=True`: the release's for k3, a small one otherwise."""
    return VisionConfig(text_hidden_size=hidden_size) if name == "k3" else small_vision(hidden_size)


VISION_BY_DEFAULT = ("k3",)
K3_MEDIA_PLACEHOLDER_TOKEN_ID = 163_605  # `<|media_pad|>` in the release's vocabulary


def preset_names() -> list[str]:
    return sorted(_PRESETS)
