"""The tiktoken tokenizer of the Kimi K3 release: `tiktoken.model` ranks + special tokens from its config files.

Directory layout read (and written by `save`), as the release ships it:
- `tiktoken.model`: one `<base64 token bytes> <rank>` per line; ranks are the ids of the base vocabulary.
- `tokenizer_config.json`: `added_tokens_decoder` {id: {"content": text, "special": true}}, `bos_token`,
  `eos_token`, `pad_token` (text or {"content": text}); optional `added_tokens.json` {text: id};
  optional `chat_template.jinja` (or a `chat_template` string in the config); in an HF checkpoint directory
  `generation_config.json`'s `eos_token_id` (the release's stop token, 163586) names eos.
The 256 ids after the base vocabulary are special tokens; unnamed ones are `<|reserved_token_<id>|>`
(163,584 + 256 = 163,840 ids for the release: bos 163584, eos 163586, pad 163839).

Encoding goes through `tiktoken.Encoding` with K3's pre-tokenisation pattern (data/k3_format.py). Text is
encoded as ordinary text (`encode_ordinary`): special-token text inside user content never becomes a control
token unless the caller allows it by name (`allowed_special`); a special token is never split when allowed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import tiktoken

from data.config import DataError
from data.files import atomic_write
from data.k3_format import BOS_TOKEN, EOS_TOKEN, K3_PAT_STR, NUM_RESERVED_SPECIAL_TOKENS, PAD_TOKEN, reserved_name
from data.tokenizer_base import KINDS, AllowedSpecial, Tokenizer


def read_ranks(path: Union[str, os.PathLike]) -> dict[bytes, int]:
    """`tiktoken.model` -> {token bytes: rank}; one-line DataError naming the bad line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except ValueError as e:
                raise DataError(f"{path}:{n} is not '<base64> <rank>' ({e}): not a tiktoken.model file") from None
    return ranks


def ranks_bytes(ranks: dict[bytes, int]) -> bytes:
    """The `tiktoken.model` text of `ranks`, in rank order."""
    return b"".join(
        base64.b64encode(t) + b" " + str(r).encode() + b"\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
    )


def _token_text(v: Any) -> Optional[str]:
    return v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None


def read_specials(directory: Path, num_base: int) -> tuple[dict[str, int], dict[str, Optional[str]], Optional[str]]:
    """(special tokens, {bos/eos/pad: text}, chat template) from the release's config files."""
    cfg: dict = {}
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise DataError(f"{cfg_path} is not valid JSON ({e}): restore the release's file") from None
    named: dict[int, str] = {}
    for key, attrs in (cfg.get("added_tokens_decoder") or {}).items():
        text = _token_text(attrs)
        if text is not None and str(key).isdigit():
            named[int(key)] = text
    added_path = directory / "added_tokens.json"
    if added_path.is_file():
        for text, i in json.loads(added_path.read_text(encoding="utf-8")).items():
            named.setdefault(int(i), text)
    top = max([num_base + NUM_RESERVED_SPECIAL_TOKENS - 1, *named])
    specials = {named.get(i, reserved_name(i)): i for i in range(num_base, top + 1)}
    roles = {k: _token_text(cfg.get(f"{k}_token")) for k in ("bos", "eos", "pad")}
    gen_path = directory / "generation_config.json"  # an HF checkpoint's stop token is the run's eos
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text(encoding="utf-8")).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        names = {i: t for t, i in specials.items()}
        if isinstance(eos, int) and eos in names:
            roles["eos"] = names[eos]
    template = None
    tpl = directory / "chat_template.jinja"
    if tpl.is_file():
        template = tpl.read_text(encoding="utf-8")
    elif isinstance(cfg.get("chat_template"), str):
        template = cfg["chat_template"]
    return specials, roles, template


_RELEASE_FILES = (
    "tiktoken.model",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenization_kimi.py",
)


class TiktokenTokenizer(Tokenizer):
    """BPE ranks + special tokens + pattern, encoded by the `tiktoken` package."""

    kind = "tiktoken"

    def __init__(
        self,
        ranks: dict[bytes, int],
        specials: dict[str, int],
        roles: dict[str, Optional[str]],
        chat_template: Optional[str] = None,
        pat_str: str = K3_PAT_STR,
        path: Optional[str] = None,
        num_threads: int = 1,
    ):
        overlap = set(ranks.values()) & set(specials.values())
        if overlap:
            raise DataError(
                f"special token ids {sorted(overlap)[:4]} collide with BPE ranks: the tokenizer files "
                f"disagree (tiktoken.model vs tokenizer_config.json)"
            )
        self.enc = tiktoken.Encoding(name="k3", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=specials)
        self.ranks, self._specials, self.roles = ranks, dict(specials), dict(roles)
        self.pat_str, self.chat_template, self.path, self.num_threads = pat_str, chat_template, path, num_threads
        self._ids = {r: self._specials.get(t) if t else None for r, t in roles.items()}
        h = hashlib.sha256(ranks_bytes(ranks))
        h.update(json.dumps([sorted(specials.items()), roles, pat_str], sort_keys=True).encode())
        self.fingerprint = h.hexdigest()[:16]

    @classmethod
    def load(cls, path: Union[str, os.PathLike], num_threads: int = 1) -> TiktokenTokenizer:
        p = Path(path).expanduser()
        main = p / "tiktoken.model" if p.is_dir() else p
        if not main.is_file():
            raise DataError(
                f"{str(path)!r} has no tiktoken.model: point data.tokenizer.model_path at a directory "
                f"in the K3 release layout (python -m data.tokenizer build-tiktoken makes one)"
            )
        ranks = read_ranks(main)
        specials, roles, template = read_specials(main.parent, len(ranks))
        defaults = {"bos": BOS_TOKEN, "eos": EOS_TOKEN, "pad": PAD_TOKEN}
        roles = {
            k: v if v is not None else (defaults[k] if defaults[k] in specials else None) for k, v in roles.items()
        }
        return cls(ranks, specials, roles, template, path=str(main), num_threads=num_threads)

    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    @property
    def bos_id(self) -> Optional[int]:
        return self._ids["bos"]

    @property
    def eos_id(self) -> Optional[int]:
        return self._ids["eos"]

    @property
    def pad_id(self) -> Optional[int]:
        return self._ids["pad"]

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    def encode(self, text: str, allowed_special: AllowedSpecial = frozenset()) -> list[int]:
        if not allowed_special:
            return self.enc.encode_ordinary(text)
        return self.enc.encode(text, allowed_special=allowed_special, disallowed_special=())

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(list(texts), num_threads=self.num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode([int(i) for i in ids])

    def config_json(self) -> dict:
        """The `tokenizer_config.json` content describing this tokenizer (release field names)."""
        return {
            "tokenizer_class": "TikTokenTokenizer",
            "added_tokens_decoder": {
                str(i): {
                    "content": t,
                    "special": True,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "single_word": False,
                }
                for t, i in sorted(self._specials.items(), key=lambda kv: kv[1])
            },
            **{f"{k}_token": v for k, v in self.roles.items()},
            "model_max_length": 1_048_576,
        }

    def save(self, directory: Union[str, os.PathLike]) -> Path:
        """Write tiktoken.model, tokenizer_config.json (and chat_template.jinja) into `directory`.

        A tokenizer loaded from files copies them byte for byte (the release's config keeps all its fields)."""
        d = Path(directory)
        src = Path(self.path).parent if self.path else None
        if src is not None and src.resolve() != d.resolve() and Path(self.path).name == "tiktoken.model":
            for name in _RELEASE_FILES:
                if (src / name).is_file():
                    atomic_write(d / name, (src / name).read_bytes())
            return d / "tiktoken.model"
        out = atomic_write(d / "tiktoken.model", ranks_bytes(self.ranks))
        atomic_write(d / "tokenizer_config.json", json.dumps(self.config_json(), indent=1, ensure_ascii=False))
        if self.chat_template is not None:
            atomic_write(d / "chat_template.jinja", self.chat_template)
        return out


KINDS["tiktoken"] = TiktokenTokenizer
