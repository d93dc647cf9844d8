"""Multiple choice by log-likelihood (HellaSwag format): `eval.tasks: [{type: choice, name, path | dataset | source}]`.

Items are JSON lines `{ctx | ctx_a + ctx_b, endings: [...], label: int | str, activity_label?}` (also the HF
`hellaswag` dataset's rows: `dataset: hellaswag`, `split: validation`). As lm-eval-harness does, the context is
`activity_label: ctx` and each ending is scored as the continuation `" " + ending`: its tokens are
`encode(context + continuation)[len(encode(context)):]` and its score the summed log-likelihood of those tokens
given the context (no sampling); `context_tokens` keeps only the context's last tokens. `acc`: the best-scoring
ending is the label; `acc_norm`: the same with each score divided by the continuation's length in characters
(leading space included; lm-eval / OLMo). Every (item, ending) pair is one document segment of a packed row; rows
are sharded over data-parallel ranks and the per-pair sums all-reduced, so the numbers are the same at any layout.
`limit` keeps the first N items.

`source: embedded` is the shipped task, built deterministically from the held-out share of the embedded corpus
(data/holdout.py, never trained on): a snippet of a standard-library module ending in the first word of a line,
and which of 4 continuations (the rest of that line and the next 3 lines) is the real one; the 3 others are the
same lines in another order. Chance is 0.25.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from typing import Any

import torch

from training.eval.forward import EvalContext, pad_rows, reduce_sum, score_rows, shard_rows
from training.eval.sets import EvalConfigError

IGNORE = -100


@dataclass
class Item:
    context: str
    endings: list[str]
    label: int


def hellaswag_text(text: str) -> str:
    """lm-eval-harness' HellaSwag preprocessing: WikiHow's ` [title]` becomes `. `, other [tags] go, double spaces
    become one."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def parse_item(row: dict[str, Any], where: str) -> Item:
    """A HellaSwag-format row -> Item; EvalConfigError naming `where` when a field is missing or wrong. Rows of
    HellaSwag itself (with `ctx_a`) are read as lm-eval does: context `ctx_a + " " + ctx_b.capitalize()`, context
    and endings through `hellaswag_text`; rows with `ctx` only are used as written."""
    hellaswag = "ctx_a" in row
    ctx = row.get("ctx")
    if hellaswag:
        b = str(row.get("ctx_b") or "")
        ctx = f"{row['ctx_a']} {b[:1].upper()}{b[1:]}".rstrip()
    endings, label = row.get("endings"), row.get("label")
    if not isinstance(ctx, str) or not ctx.strip():
        raise EvalConfigError(f"{where}: no ctx (or ctx_a/ctx_b) text; use the HellaSwag fields ctx, endings, label")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        raise EvalConfigError(f"{where}: endings must be a list of >= 2 strings")
    try:
        label = int(label)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise EvalConfigError(f"{where}: label {label!r} is not an index into endings") from None
    if not 0 <= label < len(endings):
        raise EvalConfigError(f"{where}: label {label} is outside endings[0..{len(endings) - 1}]")
    act = row.get("activity_label")
    context = f"{act}: {ctx}" if act else ctx
    if hellaswag:
        return Item(hellaswag_text(context), [hellaswag_text(e) for e in endings], label)
    return Item(context, list(endings), label)


def read_jsonl(path: str) -> list[Item]:
    if not os.path.isfile(path):
        raise EvalConfigError(f"choice task file {path} does not exist: give path=<HellaSwag-format .jsonl>")
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise EvalConfigError(
                    f"{path}:{n} is not valid JSON: fix the line (one JSON object per line)"
                ) from None
            if not isinstance(row, dict):
                raise EvalConfigError(f"{path}:{n} is not a JSON object: one {{ctx, endings, label}} per line")
            items.append(parse_item(row, f"{path}:{n}"))
    if not items:
        raise EvalConfigError(f"choice task file {path} has no items: add HellaSwag-format lines")
    return items


def embedded_items(n: int, share: float = 0.02, seed: int = 0) -> list[Item]:
    """`n` line-order questions from the held-out share of the embedded corpus (deterministic in n, share, seed):
    the context is up to 24 lines of a module and the first word of the next line; the endings are the rest of
    that line and the 3 lines after it, in their real order or in 3 other orders (the same text reordered, so only
    reading the code in order tells them apart)."""
    from data import SourceConfig
    from data.sources import SourceStream

    stream = SourceStream(SourceConfig(type="embedded", holdout=share, part="heldout"), 0, 0.01, report=False)
    docs = []
    while (d := stream.next_doc()) is not None:
        docs.append(d)
    rng = random.Random(seed)
    items = []
    for text in docs:
        lines = text.split("\n")
        good = [
            i
            for i in range(8, len(lines) - 4)
            if all(len(x.strip()) >= 4 for x in lines[i : i + 4]) and len(set(lines[i : i + 4])) == 4
        ]
        for i in rng.sample(good, min(len(good), 4)):
            first, rest = lines[i], lines[i + 1 : i + 4]
            cut = first.find(" ", len(first) - len(first.lstrip()))
            if cut <= 0:
                continue
            orders = [tuple(rest)]  # a list, not a set: str hashing differs per process, the order must not
            while len(orders) < 4:
                o = tuple(rng.sample(rest, len(rest)))
                orders += [o] if o not in orders else []
            endings = ["\n".join([first[cut + 1 :], *o]) for o in orders]
            rng.shuffle(endings)
            true = "\n".join([first[cut + 1 :], *rest])
            ctx = "\n".join(lines[max(0, i - 24) : i]) + "\n" + first[:cut]
            items.append(Item(ctx, endings, endings.index(true)))
    rng.shuffle(items)
    return items[:n]


class ChoiceTask:
    def __init__(self, name: str, spec: dict[str, Any], tokenizer: Any, seq_len: int) -> None:
        self.name = name
        items = load_items(spec)
        limit = int(spec.get("limit") or 0)
        self.items = items[:limit] if limit else items
        self.pairs: list[tuple[int, int]] = []  # (item, ending) per scored continuation
        self.chars: list[int] = []
        segs = []  # (ids, first continuation position) per pair
        max_ctx = int(spec.get("context_tokens") or seq_len)  # the context's last tokens kept (cheaper scoring)
        for i, it in enumerate(self.items):
            ctx_ids = tokenizer.encode(it.context)
            for j, ending in enumerate(it.endings):
                cont = " " + ending
                whole = tokenizer.encode(it.context + cont)
                cont_ids = whole[len(ctx_ids) :] if whole[: len(ctx_ids)] == ctx_ids else tokenizer.encode(cont)
                if not cont_ids:
                    raise EvalConfigError(f"eval task {name}: item {i} ending {j} has no tokens")
                ids = (ctx_ids[-max_ctx:] + cont_ids)[-seq_len:]
                if len(ids) <= len(cont_ids):
                    raise EvalConfigError(
                        f"eval task {name}: item {i} ending {j} needs {len(cont_ids) + 1} tokens > train.seq_len="
                        f"{seq_len}: raise train.seq_len or shorten the endings"
                    )
                segs.append((ids, len(ids) - len(cont_ids)))
                self.pairs.append((i, j))
                self.chars.append(len(cont))
        self._pack(segs, seq_len)

    def _pack(self, segs: list[tuple[list[int], int]], T: int) -> None:
        """Pairs -> rows of T tokens (each pair a segment); owner_RT[r, t] = the pair whose token t + 1 is."""
        packed: list[tuple[list[int], list[int], list[int]]] = [([], [], [])]  # per row: ids, owners, starts
        for p, (ids, first) in enumerate(segs):
            if len(packed[-1][0]) + len(ids) > T:
                packed.append(([], [], []))
            row, owner, starts = packed[-1]
            starts.append(len(row))
            owner.extend([-1] * (first - 1) + [p] * (len(ids) - first) + [-1])  # t predicts t + 1
            row.extend(ids)
        R = len(packed)
        self.ids_RT = torch.zeros(R, T, dtype=torch.int64)
        self.labels_RT = torch.full((R, T), IGNORE, dtype=torch.int64)
        self.owner_RT = torch.full((R, T), -1, dtype=torch.int64)
        for r, (ids, owner, _) in enumerate(packed):
            self.ids_RT[r, : len(ids)] = torch.tensor(ids)
            self.owner_RT[r, : len(owner)] = torch.tensor(owner)
            tgt = torch.nonzero(self.owner_RT[r] >= 0).squeeze(-1) + 1
            self.labels_RT[r, tgt] = self.ids_RT[r, tgt]
        self.starts = [starts for _, _, starts in packed]

    def evaluate(self, ctx: EvalContext) -> dict[str, float]:
        ll = torch.zeros(len(self.pairs), dtype=torch.float64)
        for index in shard_rows(self.ids_RT.shape[0], ctx):
            ids, labels, starts = pad_rows(self.ids_RT, self.labels_RT, self.starts, index)
            sc = score_rows(ctx, ids, labels, starts)
            own = torch.stack(
                [self.owner_RT[i] if i is not None else torch.full_like(self.owner_RT[0], -1) for i in index]
            )
            own_N = own.reshape(-1)
            hit = own_N >= 0
            ll.index_add_(0, own_N[hit], -sc.nll_N[hit])
        ll = reduce_sum(ll)
        chars = torch.tensor(self.chars, dtype=torch.float64)
        acc = acc_norm = 0
        for i, it in enumerate(self.items):
            mine = [p for p, (item, _) in enumerate(self.pairs) if item == i]
            acc += int(max(mine, key=lambda p: float(ll[p])) - mine[0] == it.label)
            acc_norm += int(max(mine, key=lambda p: float(ll[p] / chars[p])) - mine[0] == it.label)
        n = len(self.items)
        return {"acc": acc / n, "acc_norm": acc_norm / n, "n": float(n)}

    @staticmethod
    def check(spec: dict[str, Any], cfg: Any) -> None:
        """Pre-flight: exactly one of path / dataset / source, and a path's file parses."""
        given = [k for k in ("path", "dataset", "source") if spec.get(k)]
        if len(given) != 1:
            raise EvalConfigError(
                f"eval task {spec.get('name') or 'choice'}: give exactly one of path=<jsonl>, dataset=<HF name> "
                f"or source=embedded (got {given or 'none'})"
            )
        if spec.get("source") not in (None, "embedded"):
            raise EvalConfigError(f"eval task {spec.get('name')}: source={spec['source']!r}; the built-in is embedded")
        if spec.get("path"):
            read_jsonl(str(spec["path"]))


def load_items(spec: dict[str, Any]) -> list[Item]:
    if spec.get("path"):
        return read_jsonl(str(spec["path"]))
    if spec.get("dataset"):
        import datasets

        split = str(spec.get("split") or "validation")
        ds = datasets.load_dataset(str(spec["dataset"]), spec.get("config"), split=split)
        return [parse_item(dict(r), f"{spec['dataset']}[{split}][{k}]") for k, r in enumerate(ds)]
    return embedded_items(int(spec.get("n") or 64), float(spec.get("holdout") or 0.02), int(spec.get("seed") or 0))
