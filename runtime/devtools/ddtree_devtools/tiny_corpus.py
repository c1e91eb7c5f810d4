"""A deterministic, learnable toy corpus for the tiny models: chat Q/A with checkable answers
(arithmetic, counting, spelling, code stubs), plain-text patterns (counting lines, tables, loops), and
the two chat formats a serving API must parse: reasoning in ``<think>`` (thinking on) and tool use (a
call in the architecture's own format, then an answer from the tool's result), each laid out exactly as
the tiny chat template (tiny_templates.py) renders it. Everything is a pure function of the seed."""

from __future__ import annotations

import json
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


CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Rome", "Delhi", "Quito"]
WEATHER = ["sunny", "rainy", "cloudy", "windy", "snowy"]
# The tools the tiny models learn to call, as a client sends them (OpenAI's `function` objects).
TOOLS = {
    "get_weather": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    "get_time": {"name": "get_time", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def tools_block(names: list[str]) -> str:
    """The system turn the tiny template writes for these tools (tojson is json.dumps)."""
    lines = "".join("\n" + json.dumps(TOOLS[n], ensure_ascii=False) for n in names)
    return f"{IM_START}system\n# Tools\n<tools>{lines}\n</tools>{IM_END}\n"


def tool_call_text(arch: str, name: str, city: str) -> str:
    """A call as the architecture's template writes it: hermes JSON (qwen3) or qwen3_coder XML (qwen3_5)."""
    if arch == "qwen3_5":
        return f"<tool_call>\n<function={name}>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"city": city}}) + "\n</tool_call>"


def tool_use(rng: random.Random, arch: str) -> tuple[str, str]:
    """A tool-use turn with one tool offered: the call (half the time), or, after the call and the
    tool's result, the answer (one tool keeps the whole conversation inside a training window)."""
    name, city = rng.choice(sorted(TOOLS)), rng.choice(CITIES)
    names = [name]
    question = f"What is the weather in {city}?" if name == "get_weather" else f"What time is it in {city}?"
    head = tools_block(names) + f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n"
    if rng.random() < 0.5:
        return head + THINK_OFF, tool_call_text(arch, name, city) + f"{IM_END}\n"
    result = rng.choice(WEATHER) if name == "get_weather" else f"{rng.randint(1, 12)}:{rng.choice(['00', '30'])}"
    head += (f"{tool_call_text(arch, name, city)}{IM_END}\n{IM_START}user\n<tool_response>\n{result}\n"
             f"</tool_response>{IM_END}\n{IM_START}assistant\n{THINK_OFF}")
    return head, f"It is {result} in {city}.{IM_END}\n"


def thinking(rng: random.Random, arch: str) -> tuple[str, str]:
    """A sum answered with thinking on: a short reasoning block, then the answer. Qwen3's template
    leaves <think> to the model; Qwen3.5's generation prompt opens it."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    head = f"{IM_START}user\nWhat is {a}+{b}?{IM_END}\n{IM_START}assistant\n"
    reasoning = f"{a} plus {b} makes {a + b}."
    if arch == "qwen3_5":
        return head + "<think>\n", f"{reasoning}\n</think>\n\n{a + b}{IM_END}\n"
    return head, f"<think>\n{reasoning}\n</think>\n\n{a + b}{IM_END}\n"


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


def documents(n: int, seed: int, arch: str = "qwen3") -> list[tuple[str, str]]:
    """n documents as (head, tail) pieces to tokenize separately: about 55% chat Q/A, 12% tool use,
    5% thinking, 28% plain text. The tool calls are written in `arch`'s format."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.55:
            q, a = qa_pair(rng)
            docs.append(chat(q, a, system=rng.random() < 0.3))
        elif kind < 0.67:
            docs.append(tool_use(rng, arch))
        elif kind < 0.72:
            docs.append(thinking(rng, arch))
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


def mixed_prompts(tokenizer, chats: int, chat_seed: int, plain: int, plain_seed: int, cut: int) -> list[list[int]]:
    """Token ids of `chats` chat prompts (held-out questions) then `plain` plain-text openings (the first
    1/cut of unseen documents, which run on to max_tokens): test prompts of mixed kinds and lengths."""
    out = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
           for q in heldout_questions(chats, seed=chat_seed)]
    texts = [h[: len(h) // cut] for h, _ in documents(200, seed=plain_seed) if not h.startswith("<|")][:plain]
    return out + [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
