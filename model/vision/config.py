"""VisionConfig: the MoonViT-V2 tower + `patchmergerv2` projector, mirroring the released HF `vision_config` keys.

Field names are the release's (`vt_hidden_size`, `qkv_hidden_size`, ...) so `config.json` round-trips; the
structural switches the release fixes (RMSNorm, no biases, bilinear position table, `sd2_tpool` merge,
`patchmergerv2`) are kept as keys but only their K3 values are accepted, so a config this code cannot build fails
with one line instead of loading into the wrong network. Project-only keys: `vt_norm_eps`, `rope_theta`,
`in_patch_limit`, `patch_limit_per_side` (saved; other readers ignore them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# the only values of the release's structural switches this implementation builds (the K3 release's)
_FIXED = {
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "projector_hidden_act": "gelu",
    "norm_type": "rmsnorm",
    "attn_bias": False,
    "patch_embed_proj_bias": False,
    "mlp_type": "mlp2",
    "linear_bias": False,
    "activation_func": "gelu_pytorch_tanh",
    "pos_emb_interpolation_mode": "bilinear",
}


class VisionConfigError(ValueError):
    """A vision configuration that cannot be built; the message names the key and the fix."""


@dataclass
class VisionConfig:
    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    pos_emb_type: str = "divided_fixed"
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    merge_type: str = "sd2_tpool"
    mm_projector_type: str = "patchmergerv2"
    mm_hidden_size: int | None = None  # the release sets it to vt_hidden_size (unused by patchmergerv2)
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    qkv_hidden_size: int = 1536  # heads * head_dim (1536 = 12 x 128); may differ from vt_hidden_size
    norm_type: str = "rmsnorm"
    attn_bias: bool = False
    patch_embed_proj_bias: bool = False
    mlp_type: str = "mlp2"
    linear_bias: bool = False
    activation_func: str = "gelu_pytorch_tanh"
    pos_emb_interpolation_mode: str = "bilinear"
    text_hidden_size: int = 7168  # the projector's output width: the LM's hidden_size
    # --- project-only -------------------------------------------------------------------------------------------
    vt_norm_eps: float = 1e-6  # the tower's RMSNorm eps (not in the release config: an assumption, docs/model.md)
    rope_theta: float = 10000.0  # 2-D RoPE base (the public MoonViT code's constant)
    in_patch_limit: int = 65_536  # patches per image
    patch_limit_per_side: int = 512  # patches along either side

    def __post_init__(self) -> None:
        self.merge_kernel_size = [int(k) for k in self.merge_kernel_size]
        if self.mm_hidden_size is None:
            self.mm_hidden_size = self.vt_hidden_size
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_dim(self) -> int:
        """Width of one merged token: the kh x kw patches concatenated."""
        kh, kw = self.merge_kernel_size
        return kh * kw * self.vt_hidden_size

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise VisionConfigError(f"vision_config.{msg}")

        for key in (
            "patch_size",
            "init_pos_emb_height",
            "init_pos_emb_width",
            "vt_num_attention_heads",
            "vt_num_hidden_layers",
            "vt_hidden_size",
            "vt_intermediate_size",
            "qkv_hidden_size",
            "text_hidden_size",
            "in_patch_limit",
            "patch_limit_per_side",
        ):
            v = getattr(self, key)
            need(
                isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{key} must be a positive integer, got {v!r}"
            )
        for key, want in _FIXED.items():
            need(getattr(self, key) == want, f"{key} must be {want!r} (the K3 release's), got {getattr(self, key)!r}")
        need(
            self.qkv_hidden_size % self.vt_num_attention_heads == 0,
            f"qkv_hidden_size ({self.qkv_hidden_size}) must be divisible by vt_num_attention_heads "
            f"({self.vt_num_attention_heads})",
        )
        need(
            self.head_dim % 4 == 0,
            f"qkv_hidden_size / vt_num_attention_heads = {self.head_dim} must be a multiple "
            "of 4 (2-D RoPE rotates x and y pairs)",
        )
        need(
            len(self.merge_kernel_size) == 2 and min(self.merge_kernel_size) >= 1,
            f"merge_kernel_size must be two positive ints, got {self.merge_kernel_size}",
        )
        need(self.vt_norm_eps >= 0 and self.projector_ln_eps >= 0, "vt_norm_eps/projector_ln_eps must be >= 0")
        need(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")

    # --- HF config.json -----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        """From a released `vision_config` dict: known keys only (HF bookkeeping such as `model_type` is dropped)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["model_type"] = "kimi_k3_vision"
        return d


def small_vision(text_hidden_size: int, **overrides: Any) -> VisionConfig:
    """The tiny/small presets' tower: 2 blocks, width 64, 4 heads of 16, an 8 x 8 position table."""
    base: dict[str, Any] = dict(
        init_pos_emb_height=8,
        init_pos_emb_width=8,
        vt_num_attention_heads=4,
        vt_num_hidden_layers=2,
        vt_hidden_size=64,
        vt_intermediate_size=128,
        qkv_hidden_size=64,
        text_hidden_size=text_hidden_size,
    )
    base.update(overrides)
    return VisionConfig(**base)
