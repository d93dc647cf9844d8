"""One tokenizer interface over two kinds: sentencepiece (trained here) and tiktoken (the Kimi K3 release).

`Tokenizer` (data/tokenizer_base.py) is the interface every part of data/ (and the trainer) uses: `encode`,
`encode_batch`, `decode`, `vocab_size`, `bos_id`/`eos_id`/`pad_id`, `special_tokens`/`token_to_id`, `save(dir)`,
`fingerprint`, `chat_template` and `Tokenizer.load(dir_or_file)`, which detects the kind from the files
(`tokenizer.model` -> sentencepiece, `tiktoken.model` -> tiktoken). `prepare_tokenizer(cfg)` loads
`data.tokenizer.model_path` or trains (once, cached by content hash) the configured kind; `load_tokenizer(dir)`
brings a checkpoint's own.

Special-token text inside ordinary text (`encode(text)`) is plain text for tiktoken; control tokens are passed
to it by name (`allowed_special`) or looked up with `token_to_id`, which is how data/chat.py keeps user text from
injecting a marker. (Sentencepiece user-defined symbols are always atomic: that kind has no such switch.)

CLI: `python -m data.tokenizer train --out tok.model [--vocab-size N] [--source-type jsonl --source-path PATH]`
(sentencepiece); `python -m data.tokenizer build-tiktoken --out DIR [--vocab-size 1024]` (a small tokenizer in
the K3 release layout); `python -m data.tokenizer encode --model <file|dir> TEXT` (either kind).
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, Union

from data.config import DataConfig, DataError, SourceConfig, coerce_config
from data.sp_tokenizer import SentencePieceTokenizer, prepare_sentencepiece, train_sentencepiece
from data.tiktoken_tokenizer import TiktokenTokenizer
from data.tokenizer_base import AllowedSpecial, Tokenizer, detect_kind

__all__ = [
    "AllowedSpecial",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "detect_kind",
    "load_tokenizer",
    "prepare_tokenizer",
    "train_tokenizer",
]


def load_tokenizer(path: Union[str, os.PathLike], num_threads: int = 1, kind: str = "auto") -> Tokenizer:
    """The tokenizer at `path` (a file, a tokenizer directory or an HF checkpoint directory), kind auto-detected.

    This is what `model.init_from=<dir>` uses: the checkpoint's own tokenizer, never a newly trained one.
    """
    return Tokenizer.load(path, num_threads, kind)


def train_tokenizer(cfg: DataConfig, out_path: Union[str, os.PathLike]) -> Tokenizer:
    """Train a sentencepiece model on the configured sources (see data/sp_tokenizer.py)."""
    return train_sentencepiece(cfg, out_path)


def prepare_tokenizer(cfg) -> Tokenizer:
    """Load `data.tokenizer.model_path`, or train (once, cached by content hash) the configured kind."""
    cfg = coerce_config(cfg)
    t = cfg.tokenizer
    if t.model_path:
        return load_tokenizer(t.model_path, t.num_threads, t.type)
    if t.type == "tiktoken":
        from data.bpe import prepare_tiktoken

        return prepare_tiktoken(cfg)
    return prepare_sentencepiece(cfg)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m data.tokenizer", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train a sentencepiece model on a source (default: the embedded corpus)")
    tr.add_argument("--out", required=True)
    tr.add_argument("--vocab-size", type=int, default=4096)
    tr.add_argument("--model-type", default="bpe")
    tr.add_argument("--source-type", default="embedded")
    tr.add_argument("--source-path", default="")
    tr.add_argument("--text-field", default="text")
    tr.add_argument("--max-lines", type=int, default=2_000_000)
    bt = sub.add_parser("build-tiktoken", help="a small tiktoken tokenizer directory in the K3 release layout")
    bt.add_argument("--out", required=True)
    bt.add_argument("--vocab-size", type=int, default=1024, help="total ids incl. the 256 special tokens")
    bt.add_argument("--source-type", default="embedded")
    bt.add_argument("--source-path", default="")
    bt.add_argument("--source-format", default="text", help="text | chat (learn from message contents)")
    bt.add_argument("--max-chars", type=int, default=400_000, help="characters of text the merges are learned on")
    en = sub.add_parser("encode", help="print the ids of TEXT")
    en.add_argument("--model", required=True, help="a tokenizer file or directory (either kind)")
    en.add_argument("--allow-special", action="store_true", help="special-token text in TEXT becomes control ids")
    en.add_argument("text")
    a = p.parse_args(argv)
    try:
        if a.cmd == "train":
            cfg = DataConfig(sources=[SourceConfig(type=a.source_type, path=a.source_path, text_field=a.text_field)])
            cfg.tokenizer.vocab_size, cfg.tokenizer.model_type = a.vocab_size, a.model_type
            cfg.tokenizer.train_max_lines = a.max_lines
            tok = train_tokenizer(cfg, a.out)
            print(f"wrote {a.out}: vocab {tok.vocab_size}, sha256 {tok.fingerprint}")
        elif a.cmd == "build-tiktoken":
            from data.bpe import build_tiktoken_dir

            src = SourceConfig(type=a.source_type, path=a.source_path, format=a.source_format)
            tok = build_tiktoken_dir(a.out, a.vocab_size, DataConfig(sources=[src]), a.max_chars)
            short = (
                ""
                if tok.vocab_size == a.vocab_size
                else (
                    f"; the text supports only {tok.vocab_size - 512} of {a.vocab_size - 512} merges: "
                    "raise --max-chars "
                    f"or use more text"
                )
            )
            print(
                f"wrote {a.out}: tiktoken.model + tokenizer_config.json + chat_template.jinja, vocab "
                f"{tok.vocab_size} (bos {tok.bos_id}, eos {tok.eos_id}, pad {tok.pad_id}), sha256 "
                f"{tok.fingerprint}{short}"
            )
        else:
            tok = load_tokenizer(a.model)
            print(tok.encode(a.text, allowed_special="all" if a.allow_special else frozenset()))
    except DataError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
