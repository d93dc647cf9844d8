"""Sample from a trained model: `python -m training.generate checkpoint=<dir> prompt="..." [key=value ...]`.

The project's one generation CLI (model/generate.py holds the maths). `checkpoint` (or the first positional
argument) is an HF export (config.json + safetensors, e.g. from `python -m training.export`) or a training
checkpoint (a run dir, its checkpoints/ dir or one step_* dir; the newest complete one is consolidated from any
ZeRO stage). The tokenizer (sentencepiece or tiktoken) is the one saved next to it. Keys: prompt, prompt_ids ("1 2 3"),
max_new_tokens (64), temperature (0 = greedy), top_k, top_p, seed (0), dtype (float32|bfloat16|float64),
device (cpu), bos (null: prepend BOS exactly when the run trained with data.add_bos, read from the run's
config.yaml; true/false to force), bench (false), contexts ("100,4000"), bench_tokens (32), image (a picture file:
a multimodal checkpoint sees it before the prompt, as `<|media_begin|>image WxH<|media_content|>` + its
`<|media_pad|>` tokens + `<|media_end|>`, resized by data/images.py's rule), chat (false; true: the prompt, and the
image before it, as one user turn of K3's conversation format followed by the assistant's opening, as chat data
trains it, e.g. experiment=vlm_smoke; generation stops at the response's `<|close|>`), speculative (false; true:
greedy self-speculative decoding drafting with the model's first MTP block, model/speculative.py: the same
tokens as plain greedy, the accepted-draft rate on stderr).

Tokens stream to stdout as they are sampled; tokens/s of the decode phase goes to stderr. `bench=true` shows why
K3 decodes at a context-independent cost: KDA carries a fixed-size state and MLA attends over a 576-value latent
per token, so tokens/s at 100 vs 4,000 tokens of context stay close.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from data import DataError, Tokenizer, load_tokenizer
from data.images import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, ImageError, ImageRules, prepare_image
from model import K3ForConditionalGeneration, load_hf_checkpoint
from model.generate import generate
from model.speculative import generate_speculative
from training.tools.cli import ToolError, parse_args, run_tool
from training.tools.export import load_checkpoint_model

DEFAULTS: dict[str, Any] = {
    "checkpoint": None,
    "prompt": None,
    "prompt_ids": None,
    "max_new_tokens": 64,
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
    "seed": 0,
    "dtype": "float32",
    "device": "cpu",
    "bos": None,
    "bench": False,
    "contexts": "100,4000",
    "bench_tokens": 32,
    "image": None,
    "chat": False,
    "speculative": False,
}
_KINDS = {
    "checkpoint": str,
    "prompt": str,
    "prompt_ids": str,
    "top_k": int,
    "top_p": float,
    "bos": bool,
    "image": str,
    "chat": bool,
}
GenerateError = ToolError


def parse(argv: Sequence[str]) -> dict[str, Any]:
    return parse_args(argv, DEFAULTS, positional=("checkpoint",), kinds=_KINDS)


def trained_with_bos(*dirs: Path) -> bool:
    """data.add_bos of the run that wrote the checkpoint (its config.yaml next to it or above), else False:
    a prompt is encoded the way the model saw documents in training."""
    for d in dirs:
        for cand in (d, d.parent, d.parent.parent):
            cfg = cand / "config.yaml"
            if cfg.is_file():
                return bool(OmegaConf.load(cfg).get("data", {}).get("add_bos", False))
    return False


def is_hf_export(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def load_model(checkpoint: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model in eval mode, directory holding its files): HF export or DeepSpeed checkpoint."""
    path = Path(checkpoint)
    if not path.exists():
        raise GenerateError(f"checkpoint={checkpoint} does not exist; pass an HF export or a run directory")
    if is_hf_export(path):
        return load_hf_checkpoint(str(path), dtype=dtype, device=device).eval(), path
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's consolidation chatter must not mix into the text
            model, tag_dir = load_checkpoint_model(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise GenerateError(f"checkpoint={checkpoint}: {e}") from None
    return model.to(device=device, dtype=dtype).eval(), Path(tag_dir)


def find_tokenizer(*dirs: Path) -> Tokenizer | None:
    """The tokenizer (either kind) saved in the first of dirs, or their parents (checkpoint dir, run dir)."""
    for d in dirs:
        for cand in (d, d.parent, d.parent.parent):
            try:
                return load_tokenizer(cand)
            except DataError:
                continue
    return None


def image_prompt(model, tok: Tokenizer | None, path: str) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(the image's block of token ids, its pixel_values / grid_thws) for a multimodal model."""
    if not isinstance(model, K3ForConditionalGeneration):
        raise GenerateError(f"image={path} needs a multimodal checkpoint (config.json with a vision_config)")
    marks = {
        m: tok.token_to_id(m) if tok is not None else None for m in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD)
    }
    if tok is None or None in marks.values():
        raise GenerateError(f"image= needs the checkpoint's tokenizer with {', '.join(marks)} as special tokens")
    if marks[MEDIA_PAD] != model.media_id:
        raise GenerateError(
            f"the tokenizer's {MEDIA_PAD} is id {marks[MEDIA_PAD]} but the model's media_placeholder_token_id is "
            f"{model.media_id}; use the checkpoint's own tokenizer"
        )
    v = model.config.vision_config
    rules = ImageRules(v.patch_size, v.merge_kernel_size[0], v.in_patch_limit, v.patch_limit_per_side)
    try:
        im = prepare_image(path, rules)
    except ImageError as e:
        raise GenerateError(f"image={path}: {e}") from None
    ids = [marks[MEDIA_BEGIN], *tok.encode(f"image {im.size[0]}x{im.size[1]}"), marks[MEDIA_CONTENT]]
    ids += [marks[MEDIA_PAD]] * im.num_tokens + [marks[MEDIA_END]]
    dev, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    images = {
        "pixel_values": torch.from_numpy(im.pixel_values).to(device=dev, dtype=dtype),
        "grid_thws": torch.tensor([im.grid]),
    }
    return ids, images


def chat_prompt(model, tok: Tokenizer | None, prompt: str, image: str | None) -> tuple[list[int], dict, int]:
    """chat=true: (ids of one user turn holding the image, then the prompt, + the assistant's opening; the images;
    the `<|close|>` id that ends the response), rendered by data/chat.py exactly as training renders chat rows."""
    from data.chat import ChatRowError, K3Renderer, encode_conversations, normalize_messages
    from data.k3_format import CLOSE, MARKERS

    if tok is None or any(tok.token_to_id(m) is None for m in MARKERS):
        raise GenerateError("chat=true needs the checkpoint's tokenizer with K3's conversation markers (tiktoken)")
    content: list[dict] = [{"type": "text", "text": prompt}]
    images: dict[str, torch.Tensor] = {}
    rules = None
    if image is not None:
        _, images = image_prompt(model, tok, image)  # its checks, and the pixels the renderer's block stands for
        v = model.config.vision_config
        rules = ImageRules(v.patch_size, v.merge_kernel_size[0], v.in_patch_limit, v.patch_limit_per_side)
        content.insert(0, {"type": "image", "image": image})
    try:
        msgs = normalize_messages([{"role": "user", "content": content}], rules)
    except ChatRowError as e:
        raise GenerateError(f"chat=true: {e}") from None
    ((ids, _),) = encode_conversations(tok, [K3Renderer().render(msgs, add_generation_prompt=True)])
    return [int(i) for i in ids], images, int(tok.token_to_id(CLOSE))


class TextStream:
    """Writes the newly decoded text after each token (decoding the whole continuation keeps multi-piece
    characters and sentencepiece's leading spaces right)."""

    def __init__(self, tokenizer, out=None) -> None:
        self.tok, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.text = ""

    def __call__(self, t: torch.Tensor) -> None:
        self.ids.append(int(t[0]))
        if self.tok is None:
            self.out.write(f" {self.ids[-1]}")
        else:
            text = self.tok.decode(self.ids)
            self.out.write(text[len(self.text) :] if text.startswith(self.text) else text)
            self.text = text
        self.out.flush()


def timed_generate(model, ids: list[int], max_new_tokens: int, callback=None, **sampling) -> dict[str, Any]:
    """Run model.generate with timestamps: prefill seconds and decode tokens/s (first token excluded)."""
    stamps: list[float] = []

    def cb(t: torch.Tensor) -> None:
        stamps.append(time.perf_counter())
        if callback is not None:
            callback(t)

    prompt = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = generate(model, prompt, max_new_tokens, callback=cb, **sampling)
    n = len(stamps)
    decode_s = stamps[-1] - stamps[0] if n > 1 else 0.0
    return {
        "ids": out[0, len(ids) :].tolist(),
        "prefill_s": (stamps[0] - t0) if stamps else 0.0,
        "new_tokens": n,
        "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 else float("nan"),
    }


def bench(model, contexts: Sequence[int], new_tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    """Greedy decode of `new_tokens` after random prompts of each context length (one warm-up run first)."""
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    timed_generate(model, torch.randint(0, V, (8,), generator=g).tolist(), 4)  # warm-up
    rows = []
    for T in contexts:
        ids = torch.randint(0, V, (T,), generator=g).tolist()
        r = timed_generate(model, ids, new_tokens, eos_token_id=None)
        rows.append({"context": T, "prefill_s": r["prefill_s"], "decode_tokens_per_s": r["decode_tokens_per_s"]})
    return rows


def _main(argv: list[str]) -> int:
    a = parse(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}.get(a["dtype"])
    if dtype is None:
        raise GenerateError(f"dtype={a['dtype']} is not float32|bfloat16|float64")
    model, where = load_model(a["checkpoint"], dtype, a["device"])
    if a["bench"]:
        contexts = [int(x) for x in str(a["contexts"]).split(",") if x]
        rows = bench(model, contexts, a["bench_tokens"], a["seed"])
        print(f"{'context':>8} {'prefill s':>10} {'decode tok/s':>13} {'vs first':>9}")
        for r in rows:
            print(
                f"{r['context']:>8} {r['prefill_s']:>10.3f} {r['decode_tokens_per_s']:>13.1f} "
                f"{r['decode_tokens_per_s'] / rows[0]['decode_tokens_per_s']:>9.2f}"
            )
        return 0
    tok = find_tokenizer(where, Path(a["checkpoint"]))
    if (a["prompt"] is None) == (a["prompt_ids"] is None):
        raise GenerateError('give exactly one of prompt="text" or prompt_ids="1 2 3"')
    if a["prompt"] is not None:
        if tok is None:
            raise GenerateError(f"prompt= needs a tokenizer saved next to {where}; use prompt_ids= instead")
        ids = tok.encode(a["prompt"])
        bos = a["bos"] if a["bos"] is not None else trained_with_bos(where, Path(a["checkpoint"]))
        if bos and tok.bos_id is not None:
            ids = [tok.bos_id] + ids
    else:
        try:
            ids = [int(x) for x in a["prompt_ids"].replace(",", " ").split()]
        except ValueError:
            raise GenerateError(f"prompt_ids must be integers separated by spaces, got {a['prompt_ids']!r}") from None
    images: dict[str, torch.Tensor] = {}
    stop = None
    if a["chat"]:
        if a["prompt"] is None:
            raise GenerateError('chat=true renders prompt="text" as a user turn; prompt_ids= cannot be')
        ids, images, stop = chat_prompt(model, tok, a["prompt"], a["image"])
    elif a["image"] is not None:  # the image comes first, after BOS
        block, images = image_prompt(model, tok, a["image"])
        at = 1 if tok is not None and tok.bos_id is not None and ids[:1] == [tok.bos_id] else 0
        ids = ids[:at] + block + ids[at:]
    V = model.config.vocab_size
    if not ids or min(ids) < 0 or max(ids) >= V:
        raise GenerateError(f"prompt token ids must be non-empty and in [0, {V}); got {len(ids)} ids")
    sys.stdout.write(a["prompt"] if a["prompt"] is not None else a["prompt_ids"])
    eos = tok.eos_id if tok is not None and tok.eos_id is not None else model.config.eos_token_id
    eos = stop if stop is not None else eos
    if a["speculative"]:
        return _speculative(model, ids, a, tok, eos, bool(images))
    r = timed_generate(
        model,
        ids,
        a["max_new_tokens"],
        callback=TextStream(tok),
        temperature=a["temperature"],
        top_k=a["top_k"],
        top_p=a["top_p"],
        seed=a["seed"],
        eos_token_id=eos,
        **images,
    )
    sys.stdout.write("\n")
    print(
        f"{r['new_tokens']} tokens, prefill {len(ids)} tokens in {r['prefill_s']:.3f} s, decode "
        f"{r['decode_tokens_per_s']:.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


def _speculative(model, ids: list[int], a: dict[str, Any], tok, eos, images: bool) -> int:
    if a["temperature"] > 0 or images or getattr(model.config, "mtp_depth", 0) < 1:
        raise GenerateError("speculative=true needs temperature=0, no image and a checkpoint with model.mtp_depth >= 1")
    prompt = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    t0 = time.perf_counter()
    out, st = generate_speculative(model, prompt, a["max_new_tokens"], eos_token_id=eos)
    new = out[0, len(ids) :]
    stream = TextStream(tok)
    for t in new:
        stream(t[None])
    sys.stdout.write("\n")
    print(
        f"{len(new)} tokens in {time.perf_counter() - t0:.3f} s, speculative: {st.accepted}/{st.drafted} drafts "
        f"accepted ({100 * st.acceptance:.0f}%), {st.main_forwards} main forwards after the prefill",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_tool(_main, argv, __doc__ or "")


if __name__ == "__main__":
    sys.exit(main())
