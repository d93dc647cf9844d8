"""Conversations -> token ids + loss mask, in K3's released format or a checkpoint's own chat template.

A conversation is `[{"role": "system"|"user"|"assistant", "content": str, "name"?: str}, ...]` (the OpenAI/HF
convention; content may also be a list of `{"type": "text", "text": ...}` and, given the tower's `ImageRules`,
`{"type": "image", "image": ...}` parts: data/images.py decodes and resizes each image, K3Renderer writes its
placeholder block, and no position of that block ever carries loss). Rendering produces segments
`(text, control, loss)`: control segments are one special token each (looked up by name), every other segment
is encoded as ordinary text, so message text that spells a marker (`<|open|>` ...) stays plain text and can never
inject one. `loss` marks what the model learns under `loss_on=assistant`: everything an assistant turn produces
after its generation prompt (its content and the markers that end the turn).

- `K3Renderer`: the release's XTML format (data/k3_format.py), non-thinking mode by default: an assistant
  turn is `<|open|>message role="assistant"<|sep|><|open|>response<|sep|>` (prompt) + content +
  `<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>` (learned).
- `TemplateRenderer`: any `chat_template.jinja`, rendered with jinja2 the way HF `apply_chat_template` does
  (sandboxed environment, trim_blocks + lstrip_blocks, `messages`, `add_generation_prompt`, `bos_token`,
  `eos_token`, `raise_exception`; semantics learned from transformers' chat_template_utils, not copied).
  Message contents are rendered as unique placeholders first, so they are encoded as text and template text is
  split on the tokenizer's special tokens; an assistant span runs from the end of the generation prompt
  (rendering the turns before it with `add_generation_prompt=True`) to the end of the turn; where the turn's
  header differs from the generation prompt (e.g. a `name` attribute), from the start of its content.
`renderer_for(tokenizer)` picks K3 when the tokenizer has the four markers, else its chat template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from data.config import DataError
from data.images import (
    IMAGE_SKIP_REASONS,
    MEDIA_BEGIN,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    ImageError,
    ImageRules,
    PreparedImage,
    prepare_image,
)
from data.k3_format import CLOSE, END_OF_MSG, MARKERS, OPEN, SEP

ROLES = ("system", "user", "assistant")
CHAT_SKIP_REASONS = ("no_messages", "bad_message", "unknown_role", "template_error", *IMAGE_SKIP_REASONS)
Segment = tuple[str, bool, bool]  # (text, control token, carries loss under loss_on=assistant)


class ChatRowError(Exception):
    """A conversation that cannot be used; `kind` is one of CHAT_SKIP_REASONS (the row is skipped and counted)."""

    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass
class ChatDoc:
    """A rendered conversation with images: its segments and the prepared images, in placeholder order."""

    segments: list[Segment]
    images: list[PreparedImage]


def _parts(content: list, images: ImageRules | None, drop_images: bool = False) -> list[tuple[str, Any]]:
    """[("text", str) | ("image", PreparedImage)] of a content list; ChatRowError for a bad part or image.
    `drop_images`: image parts are left out undecoded (tokenizer training reads the text only)."""
    out: list[tuple[str, Any]] = []
    for p in content:
        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            out.append(("text", p["text"]))
        elif isinstance(p, dict) and p.get("type") == "image":
            if drop_images:
                continue
            if images is None:
                raise ChatRowError("bad_message", "an image part, but the model has no vision tower")
            try:
                out.append(("image", prepare_image(p.get("image"), images)))
            except ImageError as e:
                raise ChatRowError(e.kind, str(e)) from None
        else:
            raise ChatRowError("bad_message", "content parts must be {type: text, text: str} or {type: image, image}")
    return out


def normalize_messages(obj: Any, images: ImageRules | None = None, drop_images: bool = False) -> list[dict]:
    """Validate a conversation; returns messages with string content (text parts joined) and, where it has images
    (decoded with `images`' rules), `parts` in order. Raises ChatRowError."""
    if not isinstance(obj, list) or not obj:
        raise ChatRowError("no_messages", "messages is missing, empty or not a list")
    out = []
    for m in obj:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m.get("content") is None:
            raise ChatRowError("bad_message", "a message without role or content")
        if m["role"] not in ROLES:
            raise ChatRowError("unknown_role", f"role {m['role']!r} is not one of {ROLES}")
        content, parts = m["content"], None
        if isinstance(content, list):
            parts = _parts(content, images, drop_images)
            content = "".join(v for k, v in parts if k == "text")
        if not isinstance(content, str):
            raise ChatRowError("bad_message", "content is not text")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if parts is not None and any(k == "image" for k, _ in parts):
            msg["parts"] = parts
        for k in ("name", "reasoning_content"):
            if isinstance(m.get(k), str) and m[k]:
                msg[k] = m[k]
        out.append(msg)
    return out


def conversation_images(messages: list[dict]) -> list[PreparedImage]:
    """The images of a normalised conversation, in order (their features fill the placeholders in this order)."""
    return [v for m in messages for k, v in m.get("parts", ()) if k == "image"]


# -- K3 ---------------------------------------------------------------------------------------------------------
def _text(out: list[Segment], text: str, loss: bool = False) -> None:
    if text:
        out.append((text, False, loss))


def _content(out: list[Segment], m: dict, loss: bool) -> None:
    """A message's content: its text, or its parts with each image as its placeholder block (never loss)."""
    if "parts" not in m:
        _text(out, m["content"], loss)
        return
    for kind, value in m["parts"]:
        if kind == "text":
            _text(out, value, loss)
            continue
        out.append((MEDIA_BEGIN, True, False))
        _text(out, f"image {value.size[0]}x{value.size[1]}")
        out.append((MEDIA_CONTENT, True, False))
        out.extend([(MEDIA_PAD, True, False)] * value.num_tokens)
        out.append((MEDIA_END, True, False))


def _open(out: list[Segment], tag: str, attrs: Sequence[tuple[str, str]] = (), loss: bool = False) -> None:
    out.append((OPEN, True, loss))
    _text(out, tag, loss)
    for key, value in attrs:
        for piece in (f" {key}", '="', str(value).replace("&", "&amp;").replace('"', "&quot;"), '"'):
            _text(out, piece, loss)
    out.append((SEP, True, loss))


def _close(out: list[Segment], tag: str, loss: bool = False) -> None:
    out.append((CLOSE, True, loss))
    _text(out, tag, loss)
    out.append((SEP, True, loss))


class K3Renderer:
    """The release's conversation format for text messages, as segments."""

    name = "k3"

    def __init__(self, thinking: bool = False):
        self.thinking = thinking

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> list[Segment]:
        out: list[Segment] = []
        for m in messages:
            attrs = [("role", m["role"])] + ([("name", m["name"])] if m.get("name") else [])
            _open(out, "message", attrs)
            if m["role"] == "assistant":
                if self.thinking:
                    _open(out, "think")
                    reasoning = m.get("reasoning_content", "")
                    _text(out, reasoning if reasoning.strip() else "", True)
                    _close(out, "think", True)
                    _open(out, "response", loss=True)
                else:
                    _open(out, "response")
                _content(out, m, True)
                _close(out, "response", True)
                _close(out, "message", True)
                out.append((END_OF_MSG, True, True))
            else:
                _content(out, m, False)
                _close(out, "message")
                out.append((END_OF_MSG, True, False))
        if add_generation_prompt:
            _open(out, "message", [("role", "assistant")])
            _open(out, "think" if self.thinking else "response")
        return out

    def text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return "".join(s for s, _, _ in self.render(messages, add_generation_prompt))


# -- jinja templates --------------------------------------------------------------------------------------------
_PH = "\ue000{}\ue001"  # private-use placeholder of message i's content
_PH_RE = re.compile("\ue000([0-9]+)\ue001")


def _raise(message: str) -> None:
    raise ChatRowError("template_error", message)


class TemplateRenderer:
    """A jinja chat template (HF apply_chat_template semantics) as segments with exact assistant spans."""

    name = "template"

    def __init__(
        self,
        template: str,
        special_tokens: Sequence[str],
        bos_token: Optional[str] = None,
        eos_token: Optional[str] = None,
        pad_token: Optional[str] = None,
    ):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise DataError(f"chat_template.jinja does not compile ({e}): fix the template") from None
        self.vars = {"bos_token": bos_token or "", "eos_token": eos_token or "", "pad_token": pad_token or ""}
        specials = sorted((s for s in special_tokens if s), key=len, reverse=True)
        self.special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    def text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.vars)
        except ChatRowError:
            raise
        except Exception as e:  # noqa: BLE001 - any template failure is a bad row, counted
            raise ChatRowError("template_error", f"{type(e).__name__}: {e}") from None

    def _literal(self, out: list[Segment], text: str, loss: bool) -> None:
        pos = 0
        for m in self.special_re.finditer(text) if self.special_re else ():
            _text(out, text[pos : m.start()], loss)
            out.append((m.group(0), True, loss))
            pos = m.end()
        _text(out, text[pos:], loss)

    def render(self, messages: list[dict]) -> list[Segment]:
        if conversation_images(messages):
            raise ChatRowError("template_error", "images need the K3 format (a tokenizer with K3's markers)")
        ph = [dict(m, content=_PH.format(i)) for i, m in enumerate(messages)]
        full = self.text(ph)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] == "assistant":
                pre, done = self.text(ph[:k], True), self.text(ph[: k + 1])
                start = len(pre) if done.startswith(pre) else done.rfind(_PH.format(k))
                if start < 0 or not full.startswith(done):
                    raise ChatRowError("template_error", "the template is not prefix-stable at an assistant turn")
                spans.append((start, len(done)))
        cuts = sorted({0, len(full), *(p for s in spans for p in s)})
        out: list[Segment] = []
        for a, b in zip(cuts, cuts[1:]):
            loss = any(s <= a and b <= e for s, e in spans)
            piece, pos = full[a:b], 0
            for m in _PH_RE.finditer(piece):
                self._literal(out, piece[pos : m.start()], loss)
                i = int(m.group(1))
                if i >= len(messages):
                    raise ChatRowError("template_error", "content placeholder out of range")
                _text(out, messages[i]["content"], loss)
                pos = m.end()
            self._literal(out, piece[pos:], loss)
        if "".join(s for s, _, _ in out) != self.text(messages):
            raise ChatRowError("template_error", "the template changes message content (e.g. trims it)")
        return out


def renderer_for(tokenizer, thinking: bool = False):
    """K3Renderer when the tokenizer has K3's markers as special tokens, else its chat_template; else DataError."""
    specials = tokenizer.special_tokens
    if all(m in specials for m in MARKERS):
        return K3Renderer(thinking)
    if tokenizer.chat_template:
        names = {i: t for t, i in specials.items()}
        return TemplateRenderer(
            tokenizer.chat_template,
            list(specials),
            names.get(tokenizer.bos_id),
            names.get(tokenizer.eos_id),
            names.get(tokenizer.pad_id),
        )
    raise DataError(
        "data.sources[i].format=chat needs a tokenizer with K3's markers (<|open|> <|close|> <|sep|> "
        "<|end_of_msg|>) or a chat_template.jinja beside it: use data.tokenizer.type=tiktoken or "
        "model_path=<dir from python -m data.tokenizer build-tiktoken>"
    )


def encode_conversations(
    tokenizer, conversations: Sequence[list[Segment]], loss_on: str = "assistant"
) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids [n] int32, loss [n] bool)] per conversation; text segments are encoded in one batch."""
    texts = [s for conv in conversations for s, control, _ in conv if not control]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    out = []
    for conv in conversations:
        ids: list[int] = []
        mask: list[bool] = []
        in_media = False  # inside <|media_begin|> ... <|media_end|>: never loss, whatever loss_on says
        for s, control, loss in conv:
            if control:
                tid = tokenizer.token_to_id(s)
                if tid is None:
                    raise DataError(
                        f"the tokenizer has no special token {s!r} that the chat format needs: use the "
                        f"checkpoint's own tokenizer directory"
                    )
                piece = [tid]
            else:
                piece = next(encoded)
            in_media = in_media or (control and s == MEDIA_BEGIN)
            ids.extend(piece)
            mask.extend([(loss or loss_on == "all") and not in_media] * len(piece))
            in_media = in_media and not (control and s == MEDIA_END)
        out.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)))
    return out
