"""Log-probabilities in OpenAI's response shapes: chat's ``logprobs.content[]`` entries and the legacy
completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``.

The numbers are the engine's: the target's raw log-probabilities (before logit_bias, min_tokens,
temperature, top-k/p and min-p), as vLLM returns them by default (its ``--logprobs-mode
raw_logprobs``), one entry per returned token, the same ones ``usage.completion_tokens`` counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the server imports the engine (and torch) only where it runs one
    from ddtree_runtime.engine.types import TokenLogprob

# JSON has no -inf; OpenAI and vLLM send this floor instead
LOGPROB_FLOOR = -9999.0


@dataclass
class ReturnedToken:
    """A returned token, its log-probabilities, and where its text starts in the reply's text."""
    token_id: int
    logprobs: "TokenLogprob"
    text_offset: int


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's, Qwen's) reversed, character -> byte: printable Latin-1
    bytes stand for themselves, every other byte for the next code point from 256 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + extra)] = byte
            extra += 1
    return alphabet


class TokenTexts:
    """Each token's text and its exact UTF-8 bytes (a byte-level token may hold part of a character:
    its text then shows U+FFFD, its bytes the real ones), cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            hit = self._cache[token_id] = (text, self._bytes(token_id, text))
        return hit

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if self._byte_level and token_id not in self._added:
            alphabet = _byte_level_alphabet()
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in alphabet for ch in piece):
                return [alphabet[ch] for ch in piece]
        return list(text.encode("utf-8", errors="replace"))


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_content(texts: TokenTexts, tokens: list[ReturnedToken]) -> list[dict]:
    """Chat's ``choices[].logprobs.content``: per token its text, log-prob, bytes and top_logprobs."""
    out = []
    for t in tokens:
        text, raw = texts(t.token_id)
        top = []
        for token_id, logprob in t.logprobs.top:
            alt_text, alt_raw = texts(token_id)
            top.append({"token": alt_text, "logprob": _floor(logprob), "bytes": alt_raw})
        out.append({"token": text, "logprob": _floor(t.logprobs.logprob), "bytes": raw, "top_logprobs": top})
    return out


def completion_logprobs(texts: TokenTexts, tokens: list[ReturnedToken]) -> dict:
    """The completions API's logprobs object. Each top_logprobs dict holds the most likely tokens and
    the chosen one (OpenAI: "up to logprobs+1 elements"), the chosen one first."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        text = texts(t.token_id)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(_floor(t.logprobs.logprob))
        top = {text: _floor(t.logprobs.logprob)}
        for token_id, logprob in t.logprobs.top:
            top.setdefault(texts(token_id)[0], _floor(logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(t.text_offset)
    return out
