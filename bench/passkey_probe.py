"""How fast does a tiny K3 learn passkey retrieval? One process, no launcher: a plain AdamW loop on the passkey
documents of data/passkey.py (one per row from position 0, as `data.packing: pad` gives them), scored every
`--every` steps by the evaluation's own rows (training/eval/passkey.py `fit`: lengths x 5 depths x 4 keys).

    DS_ACCELERATOR=cpu .venv/bin/python -m bench.passkey_probe --steps 300 --T 64 --max-filler 3 --digits 2 \
        --repeats 3 --lengths 64,128

A fast loop for trying the task and model settings of experiment=passkey_smoke before a 2-rank run; prints one line
per evaluation (step, seconds, training loss, {length: (greedy acc, key log-prob)}). Chance: acc 0, log-prob
-digits * ln 10. The tokenizer is the experiment's (sentencepiece, 400 ids, trained on passkey text, cached).
Measured (AMD EPYC, 2 shared cores, load ~8): the command above reaches acc@64 1.0 at step 250 (chance until 150);
with `--repeats 1` (one question per document) 2-digit keys stay at chance through step 100, 1-digit keys through
160, 5-digit keys (the old default) through 150.
"""

from __future__ import annotations

import argparse
import ast
import random
import time

import torch

import data.passkey as P
from data.tokenizer import prepare_tokenizer
from model.config import K3Config
from model.k3 import K3ForCausalLM
from training.eval.passkey import fit

DATA = {
    "sources": [{"type": "synthetic", "path": "passkey", "format": "text", "size": 1_000_000}],
    "tokenizer": {"vocab_size": 400, "train_max_lines": 20_000},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--T", type=int, default=128, help="training row length (the trained length)")
    ap.add_argument("--max-filler", type=int, default=12, help="filler sentences per training document, at most")
    ap.add_argument("--digits", type=int, default=5)
    ap.add_argument("--answer-only", action="store_true", help="loss on the answer's tokens only")
    ap.add_argument("--repeats", type=int, default=1, help="question + answer this many times per training document")
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--lengths", default="128,256")
    ap.add_argument("--model", default="{'num_hidden_layers': 4, 'hidden_size': 128}", help="K3Config overrides")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = prepare_tokenizer(DATA)
    model = K3ForCausalLM(K3Config.preset("tiny", **ast.literal_eval(a.model)))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    erng, evals = random.Random(1), {}
    for n in (int(x) for x in a.lengths.split(",")):
        evals[n] = [fit(tok, P.random_key(erng, a.digits), n, d) for d in (0, 0.25, 0.5, 0.75, 1) for _ in range(4)]

    def batch(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        X = torch.zeros(a.batch, a.T, dtype=torch.long)  # [B, T]
        Y = torch.full((a.batch, a.T), -100, dtype=torch.long)
        for i in range(a.batch):
            key = P.random_key(rng, a.digits)
            doc = P.document(key, rng.randint(0, a.max_filler), rng.random())
            q, whole = len(tok.encode(doc)), tok.encode(doc + (" " + key + P.QUESTION) * (a.repeats - 1) + " " + key)
            whole = whole[: a.T]
            X[i, : len(whole)] = Y[i, : len(whole)] = torch.tensor(whole)
            if a.answer_only:
                Y[i, :q] = -100
        return X, Y

    @torch.no_grad()
    def evaluate() -> dict[int, tuple[float, float]]:
        model.eval()
        out = {}
        for n, rows in evals.items():
            X = torch.zeros(len(rows), n, dtype=torch.long)
            for i, (ids, ans) in enumerate(rows):
                X[i, : len(ids) + len(ans)] = torch.tensor(ids + ans)
            logp = model(X).logits.float().log_softmax(-1)  # [R, n, V]
            acc = lp = 0.0
            for i, (ids, ans) in enumerate(rows):
                p, t = logp[i, len(ids) - 1 : len(ids) - 1 + len(ans)], torch.tensor(ans)
                lp += p.gather(1, t[:, None]).sum().item()
                acc += float((p.argmax(-1) == t).all())
            out[n] = (round(acc / len(rows), 2), round(lp / len(rows), 2))
        model.train()
        return out

    rng, t0, warm = random.Random(0), time.time(), max(1, a.steps // 20)
    print(0, "0s", "-", evaluate(), flush=True)
    for step in range(1, a.steps + 1):
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, step / warm)
        X, Y = batch(rng)
        loss = model(X, labels=Y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), opt.zero_grad()
        if step % a.every == 0:
            print(step, f"{time.time() - t0:.0f}s", round(loss.item(), 3), evaluate(), flush=True)


if __name__ == "__main__":
    main()
