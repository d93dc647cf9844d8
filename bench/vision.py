"""MoonViT-V2 tower, native resolution packed vs padded: fwd+bwd patches/s and activation memory, same run.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python -m bench.vision --reps 5

The packed path is the model's (`model/vision/tower.py`): the images of a batch are one patch sequence, each image
attends within itself, nothing is padded. The peer is the usual batched ViT: every image's patch sequence padded
to the longest one, `[n, L_max, d]` through the same blocks (same weights), attention with a key mask. Both are
checked to give the same features on the real patches before timing. Throughput counts real patches only; memory
is the bytes autograd saves for backward (the activation memory of training; on CUDA also the allocator's peak).
Results: table + bench/results/vision.json; docs/performance.md quotes them.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import print_table, time_interleaved, write_json
from model.vision.config import VisionConfig
from model.vision.tower import MoonViT, apply_rope2d, image_sizes, rope2d_angles

# a mix of native resolutions (patches h x w): thumbnails to a 448 x 448 px photo, landscape and portrait
MIX = [(8, 8), (32, 32), (8, 24), (24, 16), (12, 12), (16, 40), (4, 8), (20, 20)]
QUICK_MIX = [(4, 4), (8, 8), (4, 8)]


def tower_config(quick: bool) -> VisionConfig:
    d = 128 if quick else 256
    return VisionConfig(
        init_pos_emb_height=16,
        init_pos_emb_width=16,
        vt_num_attention_heads=4,
        vt_num_hidden_layers=2 if quick else 4,
        vt_hidden_size=d,
        vt_intermediate_size=4 * d,
        qkv_hidden_size=d,
        text_hidden_size=d,
    )


def padded_features(tower: MoonViT, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
    """The peer: [n, L_max, d] padded sequences through the same blocks; returns the real patches' features."""
    c, sizes = tower.cfg, image_sizes(grid_thws)
    lengths = [h * w for h, w in sizes]
    L, n = max(lengths), len(sizes)
    x = tower.patch_embed(pixel_values, sizes)  # [N, d] (embedding + position table: per patch, no padding yet)
    ang = torch.cat([rope2d_angles(h, w, c.head_dim, c.rope_theta, x.dtype, x.device) for h, w in sizes])
    x_pad = x.new_zeros(n, L, x.shape[-1])
    a_pad = ang.new_zeros(n, L, ang.shape[-1])
    keep = torch.zeros(n, L, dtype=torch.bool)
    for i, (xs, As) in enumerate(zip(x.split(lengths), ang.split(lengths))):
        x_pad[i, : len(xs)], a_pad[i, : len(xs)], keep[i, : len(xs)] = xs, As, True
    mask = keep[:, None, None, :]  # keys that are real patches
    for blk in tower.encoder.blocks:
        h_ = blk.norm0(x_pad)
        q, k, v = blk.wqkv(h_).view(n, L, 3, blk.heads, blk.head_dim).unbind(2)  # [n, L, H, hd]
        q = apply_rope2d(q.flatten(0, 1), a_pad.flatten(0, 1)).view(n, L, blk.heads, blk.head_dim)
        k = apply_rope2d(k.flatten(0, 1), a_pad.flatten(0, 1)).view(n, L, blk.heads, blk.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x_pad = x_pad + blk.wo(o.transpose(1, 2).reshape(n, L, -1))
        x_pad = x_pad + blk.mlp(blk.norm1(x_pad))
    return tower.encoder.final_layernorm(x_pad)[keep]


def packed_features(tower: MoonViT, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
    sizes = image_sizes(grid_thws)
    return tower.encoder(tower.patch_embed(pixel_values, sizes), sizes)


def saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward during `fn()` (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def run(quick: bool, reps: int, device: str) -> dict:
    torch.manual_seed(0)
    cfg = tower_config(quick)
    mix = QUICK_MIX if quick else MIX
    tower = MoonViT(cfg).to(device)
    n_patches = sum(h * w for h, w in mix)
    px = torch.randn(n_patches, 3, cfg.patch_size, cfg.patch_size, device=device)
    grid = torch.tensor([[1, h, w] for h, w in mix])
    with torch.no_grad():
        a, b = packed_features(tower, px, grid), padded_features(tower, px, grid)
    err = float((a - b).abs().max())
    assert err < 1e-4, f"padded peer differs from the packed tower by {err}"

    def step(fwd):
        def go():
            tower.zero_grad(set_to_none=True)
            fwd(tower, px, grid).square().mean().backward()

        return go

    peers = {"packed": step(packed_features), "padded": step(padded_features)}
    t = time_interleaved(peers, reps=reps, warmup=1)
    rows = []
    L_max = max(h * w for h, w in mix)
    for name, fwd in (("packed", packed_features), ("padded", padded_features)):
        mem = saved_bytes(lambda fwd=fwd: fwd(tower, px, grid))
        peak = None
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            peers[name]()
            peak = torch.cuda.max_memory_allocated() / 2**20
        rows.append(
            {
                "peer": name,
                "patches_per_s": n_patches / t[name].median,
                "step_s": t[name].median,
                "spread": t[name].spread,
                "computed_patches": n_patches if name == "packed" else L_max * len(mix),
                "saved_MB": mem / 2**20,
                "cuda_peak_MB": peak,
            }
        )
    ratio = rows[0]["patches_per_s"] / rows[1]["patches_per_s"]
    mem_ratio = rows[1]["saved_MB"] / rows[0]["saved_MB"]
    return {
        "config": {"hidden": cfg.vt_hidden_size, "blocks": cfg.vt_num_hidden_layers, "heads": 4, "mix": mix},
        "rows": rows,
        "packed_over_padded_throughput": ratio,
        "padded_over_packed_activation_memory": mem_ratio,
        "max_abs_feature_difference": err,
        "device": device,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smaller tower and image mix (seconds; CI)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    res = run(a.quick, a.reps, a.device)
    print_table(f"MoonViT fwd+bwd, {len(res['config']['mix'])} images of mixed sizes ({a.device})", res["rows"])
    print(
        f"packed / padded patches/s: {res['packed_over_padded_throughput']:.2f}x; "
        f"activation memory padded / packed: {res['padded_over_packed_activation_memory']:.2f}x"
    )
    path = write_json("vision_quick" if a.quick else "vision", res)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
