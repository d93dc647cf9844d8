"""Long context in the loop: a passkey hidden at depth d of an N-token haystack, `{type: passkey, name, lengths,
depths, samples, digits, seed}`.

A document (data/passkey.py; also the training source of experiment=passkey_smoke) is an instruction line, filler
sentences (the classic "The grass is green. ..."), the needle "The pass key is 48213. Remember it." after a share
`d` of the filler, more filler, and the question "What is the pass key? The pass key is"; the answer is " 48213"
(its tokens: `encode(doc + answer)[len(encode(doc)):]`, as a choice continuation). Each (length, depth, sample) is
one row of `length` tokens (filler trimmed so the document fits), keys drawn from `seed`. Scores, no sampling: the
summed log-probability of the key's tokens given the document (`logprob@<length>`, mean over depths and samples) and
greedy accuracy (`acc@<length>`: every key token is the argmax given the document and the key's earlier tokens, i.e.
greedy decoding writes the key), plus each cell `acc@<length>/d<depth %>`. Lengths past one rank's memory run split
over `parallel.sp_size` ranks (training/eval/forward.py); a length must divide by it. Rank 0 writes the table
(`passkey/<name>.md`) and a heat-map (`passkey/<name>.png`, depth x length, greedy accuracy) into the run dir.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from data.passkey import document, random_key
from training.eval.forward import EvalContext, pad_rows, reduce_sum, score_rows, shard_rows
from training.eval.sets import EvalConfigError


def fit(tokenizer: Any, key: str, length: int, depth: float) -> tuple[list[int], list[int]]:
    """(document ids, answer ids) with the most filler that keeps the whole row within `length` tokens."""
    lo, hi = 0, max(1, length)  # filler sentences are >= 1 token each
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        doc = document(key, mid, depth)
        ids, whole = tokenizer.encode(doc), tokenizer.encode(doc + " " + key)
        ans = whole[len(ids) :] if whole[: len(ids)] == ids else tokenizer.encode(" " + key)
        if len(ids) + len(ans) <= length:
            best, lo = (ids, ans), mid + 1
        else:
            hi = mid - 1
    if best is None:
        need = len(tokenizer.encode(document(key, 0, depth) + " " + key))
        raise EvalConfigError(f"passkey length {length} cannot hold the needle and question ({need} tokens): raise it")
    return best


class PasskeyTask:
    def __init__(self, name: str, spec: dict[str, Any], tokenizer: Any, seq_len: int) -> None:
        self.name = name
        self.lengths = [int(n) for n in spec.get("lengths") or [seq_len]]
        self.depths = [float(d) for d in spec.get("depths") or [0.0, 0.25, 0.5, 0.75, 1.0]]
        samples, digits = int(spec.get("samples") or 2), int(spec.get("digits") or 5)
        rng = random.Random(int(spec.get("seed") or 0))
        self.groups = []  # per length: ids [R, N], labels, starts, answer lengths, cell (depth index) per row
        for n in self.lengths:
            rows, labels, cells, alen = [], [], [], []
            for di, d in enumerate(self.depths):
                for _ in range(samples):
                    key = random_key(rng, digits)
                    ids, ans = fit(tokenizer, key, n, d)
                    row = torch.zeros(n, dtype=torch.int64)
                    row[: len(ids) + len(ans)] = torch.tensor(ids + ans)
                    lab = torch.full((n,), -100, dtype=torch.int64)
                    lab[len(ids) : len(ids) + len(ans)] = row[len(ids) : len(ids) + len(ans)]
                    rows.append(row), labels.append(lab), cells.append(di), alen.append(len(ans))
            self.groups.append((torch.stack(rows), torch.stack(labels), [[0]] * len(rows), alen, cells))

    def evaluate(self, ctx: EvalContext) -> dict[str, float]:
        out: dict[str, float] = {}
        grid: list[list[float]] = []
        for n, (ids_RT, labels_RT, starts, alen, cells) in zip(self.lengths, self.groups):
            R = ids_RT.shape[0]
            sums = torch.zeros(2 * R, dtype=torch.float64)  # per row: log-prob of the key, greedy-correct tokens
            for index in shard_rows(R, ctx):
                ids, labels, st = pad_rows(ids_RT, labels_RT, starts, index)
                sc = score_rows(ctx, ids, labels, st)
                counted = sc.targets_N.reshape(len(index), n) != -100
                for k, r in enumerate(index):
                    if r is not None:
                        sums[r] -= sc.nll_N.reshape(len(index), n)[k][counted[k]].sum()
                        sums[R + r] += sc.greedy_N.reshape(len(index), n)[k][counted[k]].sum()
            sums = reduce_sum(sums)
            correct = [float(sums[R + r]) == alen[r] for r in range(R)]
            out[f"acc@{n}"] = sum(correct) / R
            out[f"logprob@{n}"] = float(sums[:R].mean())
            row = []
            for di, d in enumerate(self.depths):
                mine = [c for c, cell in zip(correct, cells) if cell == di]
                row.append(sum(mine) / len(mine))
                out[f"acc@{n}/d{round(100 * d)}"] = row[-1]
            grid.append(row)
        if ctx.is_main and ctx.out_dir:
            self.write(ctx.out_dir, grid, out)
        return out

    def write(self, out_dir: str, grid: list[list[float]], metrics: dict[str, float]) -> None:
        """passkey/<name>.md (lengths x depths table) and passkey/<name>.png (heat-map) of this evaluation."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        d = os.path.join(out_dir, "passkey")
        os.makedirs(d, exist_ok=True)
        head = "| length | " + " | ".join(f"depth {x:.2f}" for x in self.depths) + " | acc | logprob |"
        lines = [head, "|" + "---|" * (len(self.depths) + 3)]
        for n, row in zip(self.lengths, grid):
            cells = " | ".join(f"{v:.2f}" for v in row)
            lines.append(f"| {n} | {cells} | {metrics[f'acc@{n}']:.2f} | {metrics[f'logprob@{n}']:.2f} |")
        with open(os.path.join(d, f"{self.name}.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(self.lengths), 1.2 + 0.5 * len(self.depths)))
        im = ax.imshow(torch.tensor(grid).T.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(self.lengths)), [str(n) for n in self.lengths])
        ax.set_yticks(range(len(self.depths)), [f"{x:.2f}" for x in self.depths])
        ax.set_xlabel("context length (tokens)"), ax.set_ylabel("depth of the key")
        ax.set_title(f"{self.name}: greedy accuracy")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(os.path.join(d, f"{self.name}.png"), dpi=80)
        plt.close(fig)

    @staticmethod
    def check(spec: dict[str, Any], cfg: Any) -> None:
        sp = int(cfg.parallel.sp_size)
        for n in spec.get("lengths") or [int(cfg.train.seq_len)]:
            if int(n) < 64 or int(n) % sp:
                raise EvalConfigError(
                    f"eval task {spec.get('name') or 'passkey'}: length {n} must be >= 64 and divisible by "
                    f"parallel.sp_size={sp}"
                )
        for x in spec.get("depths") or []:
            if not 0.0 <= float(x) <= 1.0:
                raise EvalConfigError(f"eval task {spec.get('name') or 'passkey'}: depth {x} must be in [0, 1]")
