"""A micro multimodal K3 shared by the vision tests: the micro text model with a 2-block tower of width 16."""

from __future__ import annotations

import torch

from model.config import K3Config
from model.vision.config import VisionConfig
from tests.model.micro import micro_config

MEDIA = 60  # <|media_pad|> of the micro vocabulary (61 ids)


def micro_vision(**overrides) -> VisionConfig:
    """patch 2, a 4 x 4 position table, 2 blocks, width 16, 2 heads of 8 (qkv 16), MLP 32, LM width 32."""
    base = dict(
        patch_size=2,
        init_pos_emb_height=4,
        init_pos_emb_width=4,
        vt_num_attention_heads=2,
        vt_num_hidden_layers=2,
        vt_hidden_size=16,
        vt_intermediate_size=32,
        qkv_hidden_size=16,
        text_hidden_size=32,
    )
    base.update(overrides)
    return VisionConfig(**base)


def micro_mm_config(**overrides) -> K3Config:
    return micro_config(vision_config=micro_vision(), media_placeholder_token_id=MEDIA, **overrides)


def images(sizes: list[tuple[int, int]], patch: int = 2, dtype=torch.float64, seed: int = 0):
    """(pixel_values [N, 3, p, p], grid_thws [n, 3]) of random images with (h, w) patches each."""
    g = torch.Generator().manual_seed(seed)
    n = sum(h * w for h, w in sizes)
    px = torch.randn(n, 3, patch, patch, generator=g, dtype=dtype)
    return px, torch.tensor([[1, h, w] for h, w in sizes])


@torch.no_grad()
def randomise(model: torch.nn.Module, std: float = 0.3, seed: int = 0) -> torch.nn.Module:
    """Every floating tensor random (norm scales around 1), so no path hides behind an init of 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point():
            r = torch.randn(t.shape, generator=g, dtype=torch.float64) * std
            t.copy_((1 + r if name.endswith("norm.weight") or "norm0" in name or "norm1" in name else r).to(t.dtype))
    return model
