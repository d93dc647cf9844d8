"""MoonViT-V2, the K3 vision tower, and its `patchmergerv2` projector (docs/model.md §14).

Native resolution: the images of a batch are one packed sequence of patches `[N, 3, p, p]` (each image's patches in
row-major order) with `grid_thws [n_images, 3]` = (t = 1, h, w) patches per image. Attention stays inside each image
and nothing is padded: one attention call per image (no [N, N] mask is ever built). Module paths are the release's
checkpoint names (`vision_tower.patch_embed.proj.weight`, `vision_tower.encoder.blocks.{i}.wqkv.weight`, ...,
`mm_projector.proj.0.weight`), so `state_dict()` is the checkpoint.

Per image of h x w patches: patch embedding (a bias-free 14 x 14 stride-14 conv), plus the learnable 64 x 64 position
table bilinearly interpolated to (h, w); pre-norm blocks `x + wo(attn(rope2d(wqkv(norm0 x))))`,
`x + fc1(gelu_tanh(fc0(norm1 x)))`; a final RMSNorm; each 2 x 2 block of patches concatenated (4 x d); then the
projector Linear -> GELU -> Linear -> RMSNorm to the LM width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.norm import RMSNorm
from model.vision.config import VisionConfig


def image_sizes(grid_thws: torch.Tensor) -> list[tuple[int, int]]:
    """[(h, w)] patches per image from `grid_thws [n, 3]` (t, h, w); only still images (t == 1)."""
    if grid_thws.dim() != 2 or grid_thws.shape[1] != 3:
        raise ValueError(f"grid_thws must be [n_images, 3] (t, h, w), got {tuple(grid_thws.shape)}")
    out = []
    for t, h, w in grid_thws.tolist():
        if t != 1:
            raise ValueError(f"grid_thws has t={t}: only still images (t = 1) are supported, not video")
        out.append((int(h), int(w)))
    return out


# --- 2-D RoPE ---------------------------------------------------------------------------------------------------


def rope2d_angles(h: int, w: int, head_dim: int, theta: float, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Rotation angle of each (patch, pair) [h*w, head_dim/2] of an h x w image, patches row-major.

    Pair j of a head (elements 2j, 2j+1) rotates by x * f_{j//2} for even j and by y * f_{j//2} for odd j, with
    f_i = theta^(-4i / head_dim), x the column and y the row: the public MoonViT `Rope2DPosEmb` layout."""
    f = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float64, device=device)[: head_dim // 4] / head_dim)
    pos = torch.arange(h * w, device=device)
    x, y = (pos % w).to(torch.float64), (pos // w).to(torch.float64)
    ang = torch.stack([torch.outer(x, f), torch.outer(y, f)], dim=-1)  # [hw, hd/4, 2]: (x, y) per frequency
    return ang.reshape(h * w, head_dim // 2).to(dtype)


def apply_rope2d(x_NHD: torch.Tensor, angles_NP: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (2j, 2j+1) of every head by angles [N, D/2] (real arithmetic: works in float64)."""
    a, b = x_NHD.unflatten(-1, (-1, 2)).unbind(-1)  # [N, H, D/2] each
    cos, sin = angles_NP.cos()[:, None], angles_NP.sin()[:, None]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


# --- blocks -------------------------------------------------------------------------------------------------------


class MLP2(nn.Module):
    """fc0 -> gelu (tanh) -> fc1, no biases."""

    def __init__(self, d: int, inner: int) -> None:
        super().__init__()
        self.fc0 = nn.Linear(d, inner, bias=False)
        self.fc1 = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class MoonViTBlock(nn.Module):
    """Pre-norm block: fused qkv [3 * qkv_hidden, d] (q, k, v each heads x head_dim), 2-D RoPE on q and k."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.vt_hidden_size
        self.heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = RMSNorm(d, cfg.vt_norm_eps)
        self.norm1 = RMSNorm(d, cfg.vt_norm_eps)
        self.wqkv = nn.Linear(d, 3 * cfg.qkv_hidden_size, bias=False)
        self.wo = nn.Linear(cfg.qkv_hidden_size, d, bias=False)
        self.mlp = MLP2(d, cfg.vt_intermediate_size)

    def attention(self, x_ND: torch.Tensor, angles_NP: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        N = x_ND.shape[0]
        q, k, v = self.wqkv(x_ND).view(N, 3, self.heads, self.head_dim).unbind(1)  # [N, H, hd] each
        q, k = apply_rope2d(q, angles_NP), apply_rope2d(k, angles_NP)
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):  # one call per image
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(-1, self.heads * self.head_dim))  # [n_i, H * hd]
        return self.wo(torch.cat(outs))

    def forward(self, x_ND: torch.Tensor, angles_NP: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x_ND = x_ND + self.attention(self.norm0(x_ND), angles_NP, lengths)
        return x_ND + self.mlp(self.norm1(x_ND))


class PosEmb(nn.Module):
    """The learnable [H0, W0, d] table, bilinearly interpolated (align_corners=False) to each image's grid."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size))

    def grid(self, h: int, w: int) -> torch.Tensor:
        """[h * w, d], row-major."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        t = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", align_corners=False)
        return t[0].permute(1, 2, 0).flatten(0, 1)

    def forward(self, sizes: list[tuple[int, int]]) -> torch.Tensor:
        """[sum h*w, d]: each image's grid, images in order. A module call (not `grid` from the parent), so that
        ZeRO-3's hooks gather the table where it is read."""
        return torch.cat([self.grid(h, w) for h, w in sizes])


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.pos_emb = PosEmb(cfg)

    def forward(self, pixels_N3PP: torch.Tensor, sizes: list[tuple[int, int]]) -> torch.Tensor:
        # pixels come from the data pipeline in float32; the tower reads them in its own dtype (bf16, float64)
        x_ND = self.proj(pixels_N3PP.to(self.proj.weight.dtype)).flatten(1)  # one output pixel per patch
        return x_ND + self.pos_emb(sizes).to(x_ND.dtype)


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(MoonViTBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.vt_hidden_size, cfg.vt_norm_eps)

    def forward(self, x_ND: torch.Tensor, sizes: list[tuple[int, int]]) -> torch.Tensor:
        c = self.cfg
        angles = torch.cat(
            [rope2d_angles(h, w, c.head_dim, c.rope_theta, x_ND.dtype, x_ND.device) for h, w in sizes]
        )  # [N, hd/2]
        lengths = [h * w for h, w in sizes]
        for block in self.blocks:
            x_ND = block(x_ND, angles, lengths)
        return self.final_layernorm(x_ND)


def merge_patches(x_ND: torch.Tensor, sizes: list[tuple[int, int]], kernel: list[int]) -> torch.Tensor:
    """`sd2_tpool` for still images: each kh x kw block of patches concatenated, blocks row-major -> [M, kh*kw*d]."""
    kh, kw = kernel
    outs = []
    for seq, (h, w) in zip(x_ND.split([h * w for h, w in sizes]), sizes):
        v = seq.view(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4)  # [h/kh, w/kw, kh, kw, d]
        outs.append(v.reshape((h // kh) * (w // kw), -1))
    return torch.cat(outs)


class MoonViT(nn.Module):
    """The tower (`vision_tower.*`): packed patches [N, 3, p, p] + grid_thws -> merged features [M, kh*kw*d]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weights N(0, 0.02) (the position table too), norms 1."""
        for name, p in self.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, std=0.02)

    def check(self, pixel_values: torch.Tensor, sizes: list[tuple[int, int]]) -> None:
        c = self.cfg
        p, (kh, kw) = c.patch_size, c.merge_kernel_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be packed patches [N, 3, {p}, {p}], got {tuple(pixel_values.shape)}")
        for i, (h, w) in enumerate(sizes):
            if h % kh or w % kw:
                raise ValueError(f"image {i}: grid {h}x{w} patches is not a multiple of the {kh}x{kw} merge")
            if max(h, w) > c.patch_limit_per_side or h * w > c.in_patch_limit:
                raise ValueError(
                    f"image {i}: grid {h}x{w} patches exceeds the limits ({c.patch_limit_per_side} per side, "
                    f"{c.in_patch_limit} in all); resize it (data: the documented resize rule)"
                )
        if sum(h * w for h, w in sizes) != pixel_values.shape[0]:
            raise ValueError(
                f"grid_thws covers {sum(h * w for h, w in sizes)} patches but pixel_values has {pixel_values.shape[0]}"
            )

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        sizes = image_sizes(grid_thws)
        self.check(pixel_values, sizes)
        x = self.encoder(self.patch_embed(pixel_values, sizes), sizes)
        return merge_patches(x, sizes, self.cfg.merge_kernel_size)


class PatchMergerV2(nn.Module):
    """`mm_projector`: proj = [Linear(4d, 4d), GELU, Linear(4d, text d)] (no biases), then `post_norm` RMSNorm."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        m = cfg.merged_dim
        self.proj = nn.Sequential(
            nn.Linear(m, m, bias=False), nn.GELU(), nn.Linear(m, cfg.text_hidden_size, bias=False)
        )
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_ln_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.proj[0], self.proj[2]):
            assert isinstance(lin, nn.Linear)
            nn.init.normal_(lin.weight, std=0.02)
        self.post_norm.reset_parameters()

    def forward(self, x_MK: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(x_MK))
