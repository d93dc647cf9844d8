"""A small byte-level BPE trainer that writes a tokenizer directory in the Kimi K3 release layout.

Only the ranks file is learned here; encoding always goes through `tiktoken` (data/tiktoken_tokenizer.py). The
trainer follows the textbook algorithm (Sennrich et al. 2016, byte-level as in GPT-2; tiktoken's
`_educational.py` shows the same idea): pre-tokenise with K3's pattern, start from the 256 single bytes (rank =
byte value), and repeatedly merge the most frequent adjacent pair (ties: the smallest pair of ids), each merge
taking the next rank. Pair counts are kept incrementally (a lazy max-heap plus, per pair, the words holding
it), so a 1,024-id vocabulary learns in about a second on a few hundred KB of text.

`build_tiktoken_dir(out, vocab_size, cfg)` writes `tiktoken.model`, `tokenizer_config.json` (the 256 special
tokens after the base vocabulary: K3's named slots incl. `<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`,
the rest `<|reserved_token_N|>`) and `chat_template.jinja` (K3's conversation format).
"""

from __future__ import annotations

import heapq
import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Union

import regex

from data.config import DataConfig, DataError, cache_dir, coerce_config, digest
from data.files import atomic_dir, atomic_write
from data.k3_format import (
    BOS_TOKEN,
    EOS_TOKEN,
    K3_CHAT_TEMPLATE,
    K3_PAT_STR,
    NUM_RESERVED_SPECIAL_TOKENS,
    PAD_TOKEN,
    special_tokens,
)
from data.tiktoken_tokenizer import TiktokenTokenizer

BUILDER_VERSION = 1


def train_bpe_ranks(texts: Iterable[str], num_ranks: int, pat_str: str = K3_PAT_STR) -> dict[bytes, int]:
    """{token bytes: rank} with the 256 single bytes first and `num_ranks - 256` learned merges after them."""
    if num_ranks < 256:
        raise DataError(f"a byte-level vocabulary needs >= 256 base ranks, got {num_ranks}: raise the vocab size")
    pat = regex.compile(pat_str, flags=regex.V1)
    freq: Counter = Counter()
    for text in texts:
        freq.update(m.encode("utf-8") for m in pat.findall(text))
    vocab: list[bytes] = [bytes([b]) for b in range(256)]  # id -> bytes (id == rank)
    words = [list(w) for w in freq]  # symbols of each distinct pre-token
    counts = list(freq.values())
    pairs: Counter = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for wi, syms in enumerate(words):
        for p in zip(syms, syms[1:]):
            pairs[p] += counts[wi]
            where.setdefault(p, set()).add(wi)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    known = {b: i for i, b in enumerate(vocab)}
    while len(vocab) < num_ranks and heap:
        negc, best = heapq.heappop(heap)
        if pairs.get(best, 0) != -negc or negc == 0:
            continue  # stale heap entry
        merged = vocab[best[0]] + vocab[best[1]]
        new = known.get(merged)
        if new is None:
            new = known[merged] = len(vocab)
            vocab.append(merged)
        touched: set[tuple[int, int]] = set()
        for wi in list(where.pop(best, ())):
            syms, c = words[wi], counts[wi]
            for p in zip(syms, syms[1:]):
                pairs[p] -= c
                touched.add(p)
                s = where.get(p)
                if s is not None:
                    s.discard(wi)
            out, k = [], 0
            while k < len(syms):
                if k + 1 < len(syms) and (syms[k], syms[k + 1]) == best:
                    out.append(new)
                    k += 2
                else:
                    out.append(syms[k])
                    k += 1
            words[wi] = out
            for p in zip(out, out[1:]):
                pairs[p] += c
                touched.add(p)
                where.setdefault(p, set()).add(wi)
        for p in touched:
            if pairs[p] > 0:
                heapq.heappush(heap, (-pairs[p], p))
            else:
                pairs.pop(p, None)
    return {b: i for i, b in enumerate(vocab)}


def _corpus_texts(cfg: DataConfig, max_chars: int) -> list[str]:
    from data.sp_tokenizer import training_texts

    out, n = [], 0
    for text in training_texts(cfg, 10_000_000):
        out.append(text[: max_chars - n])
        n += len(out[-1])
        if n >= max_chars:
            break
    if not n:
        raise DataError("tiktoken tokenizer training found no text in the sources: configure a source with documents")
    return out


def build_tiktoken_dir(
    out: Union[str, os.PathLike], vocab_size: int, cfg: DataConfig | None = None, max_chars: int = 400_000
) -> TiktokenTokenizer:
    """Learn `vocab_size - 256` ranks on (at most `max_chars` of) the sources and write the release layout."""
    cfg = coerce_config(cfg if cfg is not None else DataConfig())
    if vocab_size < 256 + NUM_RESERVED_SPECIAL_TOKENS:
        raise DataError(f"vocab_size={vocab_size} is too small: the K3 layout needs >= 512 (256 bytes + 256 special)")
    ranks = train_bpe_ranks(_corpus_texts(cfg, max_chars), vocab_size - NUM_RESERVED_SPECIAL_TOKENS)
    base = len(ranks)
    specials = special_tokens(base)
    tok = TiktokenTokenizer(
        ranks,
        specials,
        {"bos": BOS_TOKEN, "eos": EOS_TOKEN, "pad": PAD_TOKEN},
        K3_CHAT_TEMPLATE,
        num_threads=cfg.tokenizer.num_threads,
    )
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    main = tok.save(d)
    atomic_write(d / "added_tokens.json", json.dumps(specials, indent=1))
    return TiktokenTokenizer.load(main, cfg.tokenizer.num_threads)


def prepare_tiktoken(cfg: DataConfig) -> TiktokenTokenizer:
    """data.tokenizer.type=tiktoken without a model_path: trained once on the sources, cached by content hash."""
    from data.sp_tokenizer import tokenizer_cache_key

    t = cfg.tokenizer
    key = digest([tokenizer_cache_key(cfg), "tiktoken", BUILDER_VERSION])
    final = cache_dir(cfg) / "tokenizers" / f"tiktoken{t.vocab_size}-{key}"
    if not (final / "tiktoken.model").is_file():
        with atomic_dir(final) as tmp:
            build_tiktoken_dir(tmp, t.vocab_size, cfg, max_chars=2_000_000)
    return TiktokenTokenizer.load(final / "tiktoken.model", t.num_threads)
