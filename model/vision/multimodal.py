"""K3ForConditionalGeneration: the release's multimodal architecture, the text model with the vision tower beside it.

`language_model` is `K3ForCausalLM` unchanged; `vision_tower` (MoonViT-V2) and `mm_projector` (`patchmergerv2`)
turn packed images into one LM-width feature per 2 x 2 patches, scattered in order into the positions of
`input_ids` holding `<|media_pad|>` (`config.media_placeholder_token_id`). The module tree is the released
checkpoint's key spelling (`language_model.model.*`, `vision_tower.*`, `mm_projector.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import K3Config
from model.k3 import K3DecoderLayer, K3ForCausalLM, K3Output
from model.sequence import SequenceShard
from model.vision.tower import MoonViT, PatchMergerV2


class K3ForConditionalGeneration(nn.Module):
    def __init__(self, config: K3Config, language_model: K3ForCausalLM | None = None) -> None:
        """`language_model`: an already built (e.g. laid-out, sharded) text model to wrap; None builds one."""
        super().__init__()
        if config.vision_config is None:
            raise ValueError("K3ForConditionalGeneration needs config.vision_config; use K3ForCausalLM for text only")
        self.config = config
        self.media_id: int = int(config.media_placeholder_token_id or 0)  # set whenever vision is (K3Config checks)
        self.vision_tower = MoonViT(config.vision_config)
        self.mm_projector = PatchMergerV2(config.vision_config)
        self.language_model = K3ForCausalLM(config) if language_model is None else language_model

    # --- the text model's training API, delegated -------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        for m in reversed(list(self.modules())):
            reset = getattr(m, "reset_parameters", None)
            if callable(reset) and m is not self:
                reset()

    def decoder_layers(self) -> list[K3DecoderLayer]:
        return self.language_model.decoder_layers()

    def moe_layers(self) -> list[nn.Module]:
        return self.language_model.moe_layers()

    def set_sequence_shard(self, shard: SequenceShard | None) -> None:
        self.language_model.set_sequence_shard(shard)

    def set_gradient_checkpointing(self, enabled: bool = True, offload: bool = False) -> None:
        self.language_model.set_gradient_checkpointing(enabled, offload=offload)

    def set_loss_tiling(self, tokens: int) -> None:
        self.language_model.set_loss_tiling(tokens)

    def set_ffn_tiling(self, tokens: int) -> None:
        self.language_model.set_ffn_tiling(tokens)

    def set_mixer_tiling(self, tokens: int) -> None:
        self.language_model.set_mixer_tiling(tokens)

    def set_expert_backend(self, name: str) -> None:
        self.language_model.set_expert_backend(name)

    # --- images -------------------------------------------------------------------------------------------------
    def image_features(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """Packed patches [N, 3, p, p] + grid_thws [n, 3] -> LM-width features [M, d], images in order."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thws))

    def idle_tower(self, like: torch.Tensor) -> torch.Tensor:
        """The tower and projector on one blank image of one merged token, summed: what a training micro-batch
        without images runs, its result multiplied by 0 (nothing is scattered, gradients are exact zeros).

        Why: under ZeRO-3 every rank gathers each tower parameter (a collective) when its module runs, and reduces
        its gradient in backward, so all ranks must run the same modules in the same order; a rank whose micro-batch
        has no image would otherwise skip the tower while the others wait in its all-gather. Under ZeRO-1/2 the
        gradient reduction likewise expects every rank to produce every parameter's gradient. Modules run once per
        forward whatever the image count (per-image work is inside them), so one blank image is the same sequence."""
        c = self.vision_tower.cfg
        kh, kw = c.merge_kernel_size
        pixels = like.new_zeros(kh * kw, 3, c.patch_size, c.patch_size)
        return self.image_features(pixels, torch.tensor([[1, kh, kw]], device=like.device)).sum()

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None,
        grid_thws: torch.Tensor | None,
        media_offset: int | None = None,
    ) -> torch.Tensor:
        """Token embeddings [B, T, d] with the image features at the `<|media_pad|>` positions, row-major.

        `media_offset` (sequence parallelism): `input_ids` is one rank's slice of a longer stream whose images are
        all given; the slice's slots take features [media_offset, media_offset + slots) (an image cut by the
        shard edge puts its first features on one rank, the rest on the next)."""
        embeds = self.language_model.model.embed_tokens(input_ids)
        slots = input_ids.eq(self.media_id)
        n_slots = int(slots.sum())
        if pixel_values is None:
            if n_slots:
                raise ValueError(
                    f"input_ids hold {n_slots} <|media_pad|> tokens (id {self.media_id}) "
                    "but no pixel_values were given; pass the images (pixel_values, grid_thws)"
                )
            return embeds + 0.0 * self.idle_tower(embeds) if self.training else embeds
        if grid_thws is None:
            raise ValueError("pixel_values need grid_thws [n_images, 3] (t, h, w patches per image)")
        feats = self.image_features(pixel_values, grid_thws)
        if media_offset is not None:
            if not 0 <= media_offset <= media_offset + n_slots <= feats.shape[0]:
                raise ValueError(
                    f"media_offset={media_offset} + {n_slots} <|media_pad|> tokens in this slice exceed the "
                    f"{feats.shape[0]} features of the images; the offset counts the slots before the slice"
                )
            mine = feats[media_offset : media_offset + n_slots]
            out = embeds.masked_scatter(slots[..., None], mine.to(embeds.dtype))
            # a slice without slots still backpropagates (zeros) through the tower: see idle_tower
            return out + 0.0 * feats.sum() if n_slots == 0 and self.training else out
        if feats.shape[0] != n_slots:
            raise ValueError(
                f"{n_slots} <|media_pad|> tokens in input_ids but the images give {feats.shape[0]} features "
                "(one per 2x2 patches); the placeholder count must match each image's grid"
            )
        return embeds.masked_scatter(slots[..., None], feats.to(embeds.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache=None,
        targets: torch.Tensor | None = None,
        media_offset: int | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
    ) -> K3Output:
        """The LM forward on `input_ids` with images; decode steps after an image prefill pass no images (the
        cache holds them), and a sampled `<|media_pad|>` there is an ordinary token. Sequence parallelism:
        `input_ids` is this rank's slice, the images the whole stream's, `media_offset` as in `embed`."""
        if pixel_values is not None and self.language_model.sequence_shard is not None and media_offset is None:
            raise ValueError("images with sequence parallelism need media_offset (the slots before this slice)")
        decoding = cache is not None and cache.seen_tokens > 0 and pixel_values is None
        embeds = self.language_model.model.embed_tokens(input_ids) if decoding else None
        if embeds is None:
            embeds = self.embed(input_ids, pixel_values, grid_thws, media_offset)
        if labels is not None:  # an image position is never a target, whatever the labels say
            labels = labels.masked_fill(input_ids == self.media_id, -100)
        return self.language_model(
            input_ids,
            labels=labels,
            cu_seqlens=cu_seqlens,
            cache=cache,
            targets=targets,
            inputs_embeds=embeds,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )
