"""Writes data/examples/chat_tiny.jsonl: a few hundred short, checkable dialogues for the sft_tiny example.

Written for this project from templates: every assistant answer is computed (arithmetic, word reversal, letter
counts, sorting, a small colour dictionary), so a model can actually learn the mapping and the loss on assistant
tokens falls. Deterministic (seeded); some rows have a system prompt, some are two user/assistant rounds.

    python -m data.examples.make_chat [--out data/examples/chat_tiny.jsonl] [--n 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from data.files import atomic_write

WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "garden",
    "window",
    "copper",
    "violet",
    "lantern",
    "harbor",
    "pencil",
    "meadow",
    "rocket",
    "silver",
    "thunder",
    "basket",
    "candle",
    "forest",
    "marble",
    "orange",
    "planet",
    "shadow",
    "spring",
    "tiger",
    "velvet",
    "winter",
)
COLOURS = {"red": "rouge", "blue": "bleu", "green": "vert", "black": "noir", "white": "blanc", "yellow": "jaune"}
SYSTEMS = ("You are a concise assistant.", "Answer in one short sentence.", "You are a helpful tutor.")
GREETINGS = (("Hello!", "Hello! How can I help you today?"), ("Hi there.", "Hi! What would you like to do?"))


def task(rng: random.Random) -> tuple[str, str]:
    """One (user question, assistant answer) pair with a computed answer."""
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    w = rng.choice(WORDS)
    if kind == 2:
        return f"Reverse the word '{w}'.", f"'{w}' reversed is '{w[::-1]}'."
    if kind == 3:
        return f"How many letters are in '{w}'?", f"'{w}' has {len(w)} letters."
    if kind == 4:
        xs = rng.sample(range(1, 50), rng.randint(3, 5))
        return (
            f"Sort these numbers: {', '.join(map(str, xs))}.",
            f"In ascending order: {', '.join(map(str, sorted(xs)))}.",
        )
    en = rng.choice(sorted(COLOURS))
    return f"How do you say '{en}' in French?", f"'{en}' in French is '{COLOURS[en]}'."


def dialogue(rng: random.Random) -> list[dict]:
    msgs: list[dict] = []
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    if rng.random() < 0.2:
        u, a = rng.choice(GREETINGS)
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    for _ in range(1 + (rng.random() < 0.3)):
        u, a = task(rng)
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs


def make(n: int = 400, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [dialogue(rng) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("chat_tiny.jsonl")))
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    text = "".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in make(a.n, a.seed))
    atomic_write(a.out, text)
    print(f"wrote {a.out}: {a.n} dialogues, {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
