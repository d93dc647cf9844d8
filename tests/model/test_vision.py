"""MoonViT-V2 and K3ForConditionalGeneration (issue 23 §1): release shapes, float64 oracles for packing, 2-D RoPE,
the 2 x 2 merge and decode with an image in the prefix; placeholder / limit errors."""

from __future__ import annotations

import math

import pytest
import torch

from model import K3Config, K3ForCausalLM, K3ForConditionalGeneration, count_params, count_vision_params
from model.config import ConfigError
from model.generate import generate
from model.k3 import K3Cache
from model.vision.tower import MoonViT, PatchMergerV2, merge_patches, rope2d_angles
from tests.model.micro import exercise_every_path
from tests.model.vision_micro import MEDIA, images, micro_mm_config, micro_vision, randomise

# --- release shapes -----------------------------------------------------------------------------------------------


def test_k3_vision_counts_are_the_release_tower_and_projector():
    cfg = K3Config.preset("k3")
    assert count_vision_params(cfg) == (401_214_464, 46_144_512)  # VISION.md: tower 401,214,464; projector 46,144,512
    assert count_params(cfg) == (2_779_484_476_000, 104_189_612_640)  # the text numbers are unchanged


def test_k3_vision_state_is_the_released_168_tensors_with_their_shapes():
    cfg = K3Config.preset("k3").vision_config
    with torch.device("meta"):
        tower, proj = MoonViT(cfg), PatchMergerV2(cfg)
    t = {f"vision_tower.{k}": tuple(v.shape) for k, v in tower.state_dict().items()}
    p = {f"mm_projector.{k}": tuple(v.shape) for k, v in proj.state_dict().items()}
    assert (len(t), len(p)) == (165, 3)
    assert t["vision_tower.patch_embed.proj.weight"] == (1024, 3, 14, 14)
    assert t["vision_tower.patch_embed.pos_emb.weight"] == (64, 64, 1024)
    assert t["vision_tower.encoder.final_layernorm.weight"] == (1024,)
    block = {k.split("blocks.26.")[1]: s for k, s in t.items() if ".blocks.26." in k}
    assert block == {
        "norm0.weight": (1024,),
        "norm1.weight": (1024,),
        "wqkv.weight": (4608, 1024),
        "wo.weight": (1024, 1536),
        "mlp.fc0.weight": (4096, 1024),
        "mlp.fc1.weight": (1024, 4096),
    }
    assert p == {
        "mm_projector.proj.0.weight": (4096, 4096),
        "mm_projector.proj.2.weight": (7168, 4096),
        "mm_projector.post_norm.weight": (7168,),
    }


def test_text_presets_stay_text_only_and_get_a_small_tower_on_request():
    assert K3Config.preset("tiny").vision_config is None and count_vision_params(K3Config.preset("tiny")) == (0, 0)
    for name in ("tiny", "small"):
        cfg = K3Config.preset(name, vision_config=True)
        tower, proj = count_vision_params(cfg)
        assert 0 < tower < 1_000_000 and cfg.vision_config.text_hidden_size == cfg.hidden_size
        assert 0 <= cfg.media_placeholder_token_id < cfg.vocab_size
    assert K3Config.preset("k3").media_placeholder_token_id == 163_605


def test_multimodal_config_round_trips_through_the_released_nesting():
    cfg = micro_mm_config()
    hf = cfg.to_hf_config()
    assert hf["architectures"] == ["KimiK3ForConditionalGeneration"] and hf["media_placeholder_token_id"] == MEDIA
    assert "vision_config" not in hf["text_config"]
    assert K3Config.from_hf_config(hf) == cfg


def test_vision_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="vision_config.norm_type must be 'rmsnorm'"):
        micro_mm_config().replace(vision_config={**micro_vision().to_dict(), "norm_type": "layernorm"})
    with pytest.raises(ConfigError, match=r"text_hidden_size \(64\) must equal hidden_size \(32\)"):
        micro_mm_config().replace(vision_config=micro_vision(text_hidden_size=64))
    with pytest.raises(ConfigError, match="media_placeholder_token_id is required"):
        micro_mm_config().replace(media_placeholder_token_id=None)


# --- tower oracles (float64) --------------------------------------------------------------------------------------


def _tower(**overrides) -> MoonViT:
    return randomise(MoonViT(micro_vision(**overrides)).double())


def test_packed_images_equal_one_image_at_a_time():
    tower = _tower()
    sizes = [(2, 6), (4, 4), (6, 2), (2, 2)]  # (4, 4) is the table's own size; the others interpolate
    px, grid = images(sizes)
    packed = tower(px, grid)
    ones, start = [], 0
    for h, w in sizes:
        ones.append(tower(px[start : start + h * w], torch.tensor([[1, h, w]])))
        start += h * w
    torch.testing.assert_close(packed, torch.cat(ones), rtol=0, atol=1e-12)


def _rope_attention_loop(block, x_ND: torch.Tensor, h: int, w: int, theta: float) -> torch.Tensor:
    """One image, one query patch at a time: rotate q_i and every k_j by 2x2 matrices, softmax, weight v, wo."""
    H, hd = block.heads, block.head_dim
    qkv = x_ND @ block.wqkv.weight.T
    q, k, v = qkv.view(-1, 3, H, hd).unbind(1)

    def rotate(vec_HD: torch.Tensor, patch: int) -> torch.Tensor:
        row, col = divmod(patch, w)
        out = vec_HD.clone()
        for j in range(hd // 2):
            freq = theta ** (-4 * (j // 2) / hd)
            ang = (col if j % 2 == 0 else row) * freq  # even pairs turn with x (column), odd with y (row)
            c, s = math.cos(ang), math.sin(ang)
            a, b = vec_HD[:, 2 * j], vec_HD[:, 2 * j + 1]
            out[:, 2 * j], out[:, 2 * j + 1] = a * c - b * s, a * s + b * c
        return out

    ks = [rotate(k[j], j) for j in range(h * w)]
    rows = []
    for i in range(h * w):
        qi = rotate(q[i], i)
        scores = torch.stack([(qi * kj).sum(-1) for kj in ks], dim=-1) / math.sqrt(hd)  # [H, n]
        p = torch.softmax(scores, dim=-1)
        rows.append(torch.einsum("hn,nhd->hd", p, v).reshape(-1))
    return torch.stack(rows) @ block.wo.weight.T


def test_rope2d_attention_equals_a_per_patch_loop():
    tower = _tower()
    block, c = tower.encoder.blocks[0], tower.cfg
    sizes = [(2, 4), (4, 2)]
    x = torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    angles = torch.cat([rope2d_angles(h, w, c.head_dim, c.rope_theta, torch.float64) for h, w in sizes])
    got = block.attention(x, angles, [8, 8])
    want = torch.cat(
        [_rope_attention_loop(block, x[:8], 2, 4, c.rope_theta), _rope_attention_loop(block, x[8:], 4, 2, c.rope_theta)]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _bilinear_loop(table_HWD: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """align_corners=False bilinear resampling, one output cell at a time (edge samples clamp)."""
    H, W, _ = table_HWD.shape

    def taps(i: int, n_out: int, n_in: int) -> tuple[int, int, float]:
        src = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        lo = min(int(math.floor(src)), n_in - 1)
        return lo, min(lo + 1, n_in - 1), src - lo

    rows = []
    for r in range(h):
        r0, r1, fr = taps(r, h, H)
        for c in range(w):
            c0, c1, fc = taps(c, w, W)
            top = table_HWD[r0, c0] * (1 - fc) + table_HWD[r0, c1] * fc
            bottom = table_HWD[r1, c0] * (1 - fc) + table_HWD[r1, c1] * fc
            rows.append(top * (1 - fr) + bottom * fr)
    return torch.stack(rows)


@pytest.mark.parametrize("size", [(4, 4), (2, 6), (6, 10), (3, 1)])
def test_position_table_is_bilinearly_resampled_to_each_grid(size):
    pos = _tower().patch_embed.pos_emb
    torch.testing.assert_close(pos.grid(*size), _bilinear_loop(pos.weight, *size), rtol=0, atol=1e-12)


def test_merge_concatenates_each_2x2_block_row_major():
    idx = torch.arange(2 * 4, dtype=torch.float64)[:, None]  # patch index as its feature, one 2 x 4 image
    merged = merge_patches(idx, [(2, 4)], [2, 2])
    assert merged.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_oversized_or_odd_grids_fail_with_one_line():
    tower = _tower(patch_limit_per_side=4)
    px, grid = images([(2, 6)])
    with pytest.raises(ValueError, match=r"image 0: grid 2x6 patches exceeds the limits \(4 per side"):
        tower(px, grid)
    px, grid = images([(3, 2)])
    with pytest.raises(ValueError, match="image 0: grid 3x2 patches is not a multiple of the 2x2 merge"):
        tower(px, grid)


# --- the multimodal model -----------------------------------------------------------------------------------------


def _mm() -> K3ForConditionalGeneration:
    m = K3ForConditionalGeneration(micro_mm_config()).double()
    randomise(m.vision_tower, seed=1), randomise(m.mm_projector, seed=2)
    return exercise_every_path(m).eval()


def _prompt(n_image_tokens: list[int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = [int(t) for t in torch.randint(0, MEDIA, (3,), generator=g)]
    for n in n_image_tokens:
        ids += [MEDIA] * n + [int(t) for t in torch.randint(0, MEDIA, (2,), generator=g)]
    return torch.tensor([ids])


def test_features_land_at_the_placeholders_in_order():
    m = _mm()
    px, grid = images([(2, 4), (4, 2)])
    ids = _prompt([2, 2])
    feats = m.image_features(px, grid)
    emb = m.embed(ids, px, grid)
    slots = (ids[0] == MEDIA).nonzero().squeeze(-1)
    torch.testing.assert_close(emb[0, slots], feats, rtol=0, atol=0)
    text = (ids[0] != MEDIA).nonzero().squeeze(-1)
    torch.testing.assert_close(emb[0, text], m.language_model.model.embed_tokens(ids)[0, text], rtol=0, atol=0)
    first = int(slots[0])
    out = m(ids, px, grid).logits
    text_only = m.language_model(ids[:, :first]).logits
    torch.testing.assert_close(out[:, :first], text_only, rtol=0, atol=1e-12)  # causal: before the image, no change


def test_incremental_decode_with_an_image_in_the_prefix_equals_the_full_forward():
    m = _mm()
    px, grid = images([(4, 2), (2, 2)])
    prompt = _prompt([2, 1])
    full_ids = generate(m, prompt, max_new_tokens=5, pixel_values=px, grid_thws=grid)
    full = m(full_ids, px, grid).logits
    cache = K3Cache.empty(m.config)
    steps = [m(prompt, px, grid, cache=cache).logits]
    for t in range(prompt.shape[1], full_ids.shape[1]):
        steps.append(m(full_ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


def test_placeholder_feature_mismatch_is_one_line():
    m = _mm()
    px, grid = images([(2, 4)])
    with pytest.raises(ValueError, match=r"3 <\|media_pad\|> tokens in input_ids but the images give 2 features"):
        m(_prompt([3]), px, grid)
    with pytest.raises(ValueError, match="but no pixel_values were given"):
        m(_prompt([2]))


def test_the_text_model_inside_is_k3_for_causal_lm_and_gets_gradients_through_the_tower():
    m = K3ForConditionalGeneration(micro_mm_config())
    assert type(m.language_model) is K3ForCausalLM
    px, grid = images([(2, 4)], dtype=torch.float32)
    ids = _prompt([2])
    m(ids, px, grid, labels=ids.masked_fill(ids == MEDIA, -100)).loss.backward()
    assert m.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0
    assert m.mm_projector.proj[0].weight.grad.abs().sum() > 0


def test_image_positions_are_never_targets():
    m = _mm()
    px, grid = images([(2, 4)])
    ids = _prompt([2])
    masked = m(ids, px, grid, labels=ids.masked_fill(ids == MEDIA, -100)).loss
    torch.testing.assert_close(m(ids, px, grid, labels=ids).loss, masked, rtol=0, atol=0)


def test_the_trainers_switches_reach_the_text_model_inside():
    """Checkpointing (with host offload), loss, FFN and KDA mixer tiling set on the multimodal model are set on its
    K3ForCausalLM (the trainer calls them on whatever model it built)."""
    mm = K3ForConditionalGeneration(micro_mm_config())
    mm.set_gradient_checkpointing(True, offload=True)
    mm.set_loss_tiling(16)
    mm.set_ffn_tiling(8)
    mm.set_mixer_tiling(2 * mm.config.kda_chunk_size)
    lm = mm.language_model
    assert all(layer.gradient_checkpointing and layer.checkpoint_offload for layer in lm.decoder_layers())
    assert lm.lm_head.tile_rows == 16
    assert {m.tile_rows for m in lm.modules() if hasattr(m, "tile_rows") and m is not lm.lm_head} == {8}
    assert {m.tile_tokens for m in lm.modules() if hasattr(m, "tile_tokens")} == {2 * mm.config.kda_chunk_size}


def test_sequence_slices_scatter_their_share_of_the_features():
    """Sequence parallelism: each token slice, given all the images and the slots before it, embeds exactly what
    the whole stream's embedding holds there, with the cut inside an image."""
    m = _mm()
    px, grid = images([(2, 4), (4, 2)])
    ids = _prompt([2, 2])
    cut = int((ids[0] == MEDIA).nonzero()[1])  # after the first image's first slot
    parts = [
        m.embed(ids[:, a:b], px, grid, media_offset=int((ids[0, :a] == MEDIA).sum()))
        for a, b in ((0, cut), (cut, ids.shape[1]))
    ]
    torch.testing.assert_close(torch.cat(parts, dim=1), m.embed(ids, px, grid), rtol=0, atol=0)


def test_an_image_less_training_batch_runs_the_tower_for_zero_gradients():
    """The idle tower (ZeRO-3: every rank gathers the same parameters): same loss, exact-zero tower gradients."""
    m = K3ForConditionalGeneration(micro_mm_config())
    ids = torch.randint(0, MEDIA, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m.eval()(ids, labels=ids).loss
    loss = m.train()(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    grads = [p.grad for p in [*m.vision_tower.parameters(), *m.mm_projector.parameters()]]
    assert all(g is not None and not g.any() for g in grads)
