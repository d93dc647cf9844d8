"""Autoregressive generation: one prefill over the prompt (chunked KDA, naive-or-absorbed MLA), then incremental
decode one token at a time from the per-layer caches (KDA recurrent + conv state, MLA absorbed latent cache).

Sampling: greedy (temperature 0), temperature, top-k, top-p, all driven by an explicit seeded torch.Generator so a
seed reproduces a sample exactly. The command line lives with the other tools: `python -m training.generate`.
"""

from __future__ import annotations

from typing import Callable

import torch

from model.k3 import K3Cache, K3ForCausalLM
from model.vision.multimodal import K3ForConditionalGeneration


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [B] from the last-position logits [B, V]. temperature <= 0 means greedy (argmax)."""
    logits = logits_BV.float()
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        # drop a token when the mass before it already reaches top_p (the most likely token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: K3ForCausalLM | K3ForConditionalGeneration,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    callback: Callable[[torch.Tensor], None] | None = None,
    pixel_values: torch.Tensor | None = None,
    grid_thws: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prompt [B, T] (or [T]) -> prompt + continuation [B, T + n] (n <= max_new_tokens; stops early once every row
    has produced `eos_token_id`, later positions of finished rows are filled with it). `callback(tokens_B)` is
    called with each new step's tokens (streaming). With a K3ForConditionalGeneration, `pixel_values`/`grid_thws`
    (the images of the prompt's `<|media_pad|>` runs) enter at the prefill; decode reads them from the cache."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.shape[1] == 0:
        raise ValueError("generate needs a non-empty prompt; pass at least one token id (e.g. BOS)")
    if generator is None:
        generator = torch.Generator(device=input_ids.device)
        if seed is not None:
            generator.manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        cache = K3Cache.empty(model.config)
        images = {} if pixel_values is None else dict(pixel_values=pixel_values, grid_thws=grid_thws)
        logits = model(input_ids, cache=cache, **images).logits[:, -1]  # prefill
        out = [input_ids]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done = done | (nxt == eos_token_id)
            out.append(nxt[:, None])
            if callback is not None:
                callback(nxt)
            if (eos_token_id is not None and bool(done.all())) or step == max_new_tokens - 1:
                break
            logits = model(nxt[:, None], cache=cache).logits[:, -1]  # incremental decode
        return torch.cat(out, dim=1)
    finally:
        model.train(was_training)
