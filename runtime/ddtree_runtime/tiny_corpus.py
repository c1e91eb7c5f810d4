"""A deterministic, learnable toy corpus for the tiny models: chat Q/A with checkable answers
(arithmetic, counting, spelling, code stubs) and plain-text patterns (counting lines, tables, loops).
Everything is a pure function of the seed."""

from __future__ import annotations

import random

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK_OFF = "<think>\n\n</think>\n\n"
SYSTEM = "You are a helpful assistant."

WORDS = ["cat", "dog", "sun", "tree", "blue", "red", "code", "fast", "tiny", "model", "token", "tree",
         "apple", "river", "stone", "green", "light", "cloud", "bird", "fish"]
NAMES = ["add", "total", "answer", "value", "count", "get_one", "make", "step", "run", "main"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def chat(question: str, answer: str, system: bool) -> tuple[str, str]:
    """One conversation in the exact layout the chat template produces (thinking off), split where
    generation starts: tokenizing the two halves apart makes training see the same token boundary
    as a real chat prompt (BPE would otherwise merge across it, e.g. "\n\n" + "5")."""
    sys = f"{IM_START}system\n{SYSTEM}{IM_END}\n" if system else ""
    return f"{sys}{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{THINK_OFF}", f"{answer}{IM_END}\n"


def qa_pair(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(9)
    if kind >= 7:  # single-digit sums (100 facts, often enough to be learnt): the smoke-test kind
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        q = f"What is {a}+{b}?" if rng.random() < 0.7 else f"What is {a} + {b}?"
        return q, str(a + b)
    if kind == 1:
        n = rng.randint(0, 98)
        return f"What comes after {n}?", str(n + 1)
    if kind == 2:
        a = rng.randint(0, 60)
        b = a + rng.randint(5, 25)
        return f"Count from {a} to {b}.", " ".join(str(i) for i in range(a, b + 1))
    if kind == 3:
        w, n = rng.choice(WORDS), rng.randint(3, 12)
        return f"Repeat the word {w} {n} times.", " ".join([w] * n)
    if kind == 4:
        i = rng.randint(0, 20)
        j = rng.randint(i + 3, 25)
        return f"Say the alphabet from {LETTERS[i]} to {LETTERS[j]}.", " ".join(LETTERS[i:j + 1])
    if kind == 5:
        f, x = rng.choice(NAMES), rng.randint(0, 99)
        return (f"Write a Python function named {f} that returns {x}.",
                f"```python\ndef {f}():\n    return {x}\n```")
    if kind == 6:
        k = rng.randint(2, 9)
        m = k * rng.randint(4, 12)
        return f"List the multiples of {k} up to {m}.", ", ".join(str(k * i) for i in range(1, m // k + 1))
    w = rng.choice(WORDS)
    return f"Spell the word {w}.", "-".join(w)  # kind 0


def plain_doc(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        a = rng.randint(0, 80)
        return ", ".join(str(i) for i in range(a, a + rng.randint(10, 30))) + "\n"
    if kind == 1:
        a = rng.randint(0, 9)
        return "".join(f"{a}+{b}={a + b}\n" for b in range(rng.randint(0, 4), 10))
    if kind == 2:
        n, k, v = rng.randint(2, 20), rng.randint(1, 9), rng.choice("ijkn")
        return f"for {v} in range({n}):\n    print({v} * {k})\n"
    pat = " ".join(rng.sample(WORDS, rng.randint(2, 4)))
    return " ".join([pat] * rng.randint(3, 8)) + "\n"


def documents(n: int, seed: int) -> list[tuple[str, str]]:
    """n documents as (head, tail) pieces to tokenize separately; about 60% chat, 40% plain text."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        if rng.random() < 0.6:
            q, a = qa_pair(rng)
            docs.append(chat(q, a, system=rng.random() < 0.3))
        else:
            docs.append((plain_doc(rng), ""))
    return docs


def heldout_questions(n: int, seed: int) -> list[str]:
    """Questions for acceptance measurement (long-answer kinds; arithmetic answers are 1-2 tokens)."""
    rng = random.Random(seed + 7919)
    out = []
    while len(out) < n:
        q, a = qa_pair(rng)
        if len(a) > 12:
            out.append(q)
    return out
