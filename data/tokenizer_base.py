"""The tokenizer interface every part of data/ (and the trainer) uses; the kinds implement it.

sentencepiece (data/sp_tokenizer.py) and tiktoken (data/tiktoken_tokenizer.py) register in `KINDS`;
`Tokenizer.load` detects the kind from the files; `data.tokenizer` imports both and is the public entry point.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Literal, Optional, Union

from data.config import DataError

AllowedSpecial = Union[Literal["all"], AbstractSet[str]]
KINDS: dict[str, type] = {}  # kind name -> class; each kind's module registers itself (data.tokenizer imports all)


class Tokenizer(abc.ABC):
    """The interface; `Tokenizer.load(path)` returns the right kind for the files at `path`."""

    kind: str  # "sentencepiece" | "tiktoken"
    fingerprint: str  # short sha256 of everything that decides the ids
    path: Optional[str]  # the main file this tokenizer was loaded from, if any
    chat_template: Optional[str] = None  # a jinja chat template shipped beside the tokenizer, if any

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def bos_id(self) -> Optional[int]: ...

    @property
    @abc.abstractmethod
    def eos_id(self) -> Optional[int]: ...

    @property
    @abc.abstractmethod
    def pad_id(self) -> Optional[int]: ...

    @property
    @abc.abstractmethod
    def special_tokens(self) -> dict[str, int]:
        """Control/special token text -> id."""

    @abc.abstractmethod
    def encode(self, text: str, allowed_special: AllowedSpecial = frozenset()) -> list[int]:
        """Ids of `text`; special-token text is plain text unless named in `allowed_special` (or "all")."""

    @abc.abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text (plain text only), batched for speed."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str: ...

    @abc.abstractmethod
    def save(self, directory: Union[str, os.PathLike]) -> Path:
        """Write the tokenizer's files into `directory`; returns the main file (loadable by `Tokenizer.load`)."""

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a special token by its text, None if this tokenizer has no such special token."""
        return self.special_tokens.get(token)

    @staticmethod
    def load(path: Union[str, os.PathLike], num_threads: int = 1, kind: str = "auto") -> Tokenizer:
        """Load a tokenizer file or directory of either kind; `kind` auto detects it from the file names."""
        found, main = detect_kind(path)
        if kind not in ("auto", found):
            raise DataError(
                f"data.tokenizer.type={kind} but {str(path)!r} holds a {found} tokenizer: set "
                f"data.tokenizer.type={found} (or auto)"
            )
        if found not in KINDS:
            raise DataError(f"the {found} tokenizer kind is not registered: load tokenizers through data.tokenizer")
        return KINDS[found].load(main, num_threads)


def detect_kind(path: Union[str, os.PathLike]) -> tuple[str, Path]:
    """(kind, main file) for a tokenizer file or a directory holding `tokenizer.model` / `tiktoken.model`."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name, kind in (("tiktoken.model", "tiktoken"), ("tokenizer.model", "sentencepiece")):
            if (p / name).is_file():
                return kind, p / name
        raise DataError(
            f"{str(path)!r} holds no tokenizer.model (sentencepiece) or tiktoken.model (tiktoken): "
            f"point data.tokenizer.model_path at a tokenizer file or directory"
        )
    if not p.is_file():
        raise DataError(
            f"tokenizer {str(path)!r} not found: set data.tokenizer.model_path to a tokenizer file or directory"
        )
    if p.name == "tiktoken.model":
        return "tiktoken", p
    with open(p, "rb") as f:
        head = f.read(64)
    looks_tiktoken = bool(head) and all(c < 128 for c in head) and b" " in head.split(b"\n")[0]
    return ("tiktoken" if looks_tiktoken else "sentencepiece"), p
