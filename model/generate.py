"""Autoregressive generation: one prefill over the prompt (chunked KDA, naive-or-absorbed MLA), then incremental
decode one token at a time from the per-layer caches (KDA recurrent + conv state, MLA absorbed latent cache).

Sampling: greedy (temperature 0), temperature, top-k, top-p, all driven by an explicit seeded torch.Generator so a
seed reproduces a sample exactly. CLI:
    python -m model.generate --checkpoint DIR --prompt-ids "1 2 3" [--max-new-tokens 32 --temperature 0.8 ...]
`--prompt "text"` works when DIR holds a sentencepiece `tokenizer.model`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

from model.k3 import K3Cache, K3ForCausalLM


def sample_next(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
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
def generate(model: K3ForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             generator: torch.Generator | None = None, eos_token_id: int | None = None,
             callback: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Prompt [B, T] (or [T]) -> prompt + continuation [B, T + n] (n <= max_new_tokens; stops early once every row
    has produced `eos_token_id`, later positions of finished rows are filled with it). `callback(tokens_B)` is
    called with each new step's tokens (streaming)."""
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
        logits = model(input_ids, cache=cache).logits[:, -1]  # prefill
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


def _load_tokenizer(checkpoint: str):
    path = os.path.join(checkpoint, "tokenizer.model")
    if not os.path.isfile(path):
        return None
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=path)


def main(argv: list[str] | None = None) -> int:
    from model.hf import load_hf_checkpoint

    ap = argparse.ArgumentParser(description="Sample from a K3 HF checkpoint.")
    ap.add_argument("--checkpoint", required=True, help="directory with config.json + safetensors")
    ap.add_argument("--prompt-ids", help='space-separated token ids, e.g. "1 2 3"')
    ap.add_argument("--prompt", help="text (needs tokenizer.model in the checkpoint directory)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    tok = _load_tokenizer(args.checkpoint)
    if (args.prompt is None) == (args.prompt_ids is None):
        ap.error("give exactly one of --prompt-ids or --prompt")
    if args.prompt is not None:
        if tok is None:
            ap.error(f"--prompt needs {os.path.join(args.checkpoint, 'tokenizer.model')}; use --prompt-ids instead")
        ids = tok.encode(args.prompt)
    else:
        try:
            ids = [int(x) for x in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            ap.error(f"--prompt-ids must be integers separated by spaces, got {args.prompt_ids!r}")
    model = load_hf_checkpoint(args.checkpoint, dtype=getattr(torch, args.dtype), device=args.device)
    vocab = model.config.vocab_size
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        ap.error(f"prompt token ids must be non-empty and in [0, {vocab}), got {ids}")

    def stream(t: torch.Tensor) -> None:
        tid = int(t[0])
        sys.stdout.write((tok.id_to_piece(tid).replace("\u2581", " ") if tok is not None else f" {tid}"))
        sys.stdout.flush()

    sys.stdout.write(args.prompt if args.prompt is not None else " ".join(map(str, ids)))
    prompt = torch.tensor([ids], dtype=torch.long, device=args.device)
    generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, seed=args.seed,
             eos_token_id=model.config.eos_token_id, callback=stream)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
