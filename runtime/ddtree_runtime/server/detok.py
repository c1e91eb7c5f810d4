"""Incremental detokenization and stop strings, for streaming text out of multi-token rounds.

Two things must be held back while streaming: a token sequence that ends inside a UTF-8 character
(decodes to U+FFFD until the next token completes it), and text that might be the start of a stop
string (it must never reach the client if the stop string completes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# An incomplete UTF-8 character has at most 3 of its bytes, so at most the last 3 tokens carry it.
MAX_PARTIAL = 3


class IncrementalDecoder:
    """Decodes a growing list of token ids into new text pieces.

    Each step decodes a small window (the previous piece's tokens + the new tokens) and keeps only the
    text the new tokens added; decoding with left context keeps word-initial spaces right for
    tokenizers that drop them at the start of a sequence. Tokens in `hidden_ids` (the control tokens,
    with skip_special_tokens) are left out of the text; every other token is decoded, special or not,
    so the tags the reply parsers read (``<think>``, ``<tool_call>``) survive whatever the tokenizer
    calls them.
    """

    def __init__(self, tokenizer: Any, hidden_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._hidden = hidden_ids
        self._ids: list[int] = []
        self._prefix = 0  # window start: context already emitted
        self._read = 0  # tokens before this have been emitted

    def _decode(self, ids: Sequence[int]) -> str:
        shown = [t for t in ids if t not in self._hidden] if self._hidden else list(ids)
        return self._tokenizer.decode(shown, skip_special_tokens=False)

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Everything not yet emitted, even an incomplete character (the generation is over)."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        end = len(self._ids) if final else self._complete_end()
        if end <= self._read:
            return ""  # wait for the rest of the character
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix : end])
        if not text.startswith(before):  # the tokenizer merged across the boundary; re-anchor
            before = ""
            text = self._decode(self._ids[self._read : end])
        self._prefix, self._read = self._read, end
        return text[len(before) :]

    def _complete_end(self) -> int:
        """How many tokens can be emitted now: all, unless the text ends in U+FFFD, which may be a
        character the next tokens complete. Only the last MAX_PARTIAL tokens can carry such a part, so
        then all but those (less, down to the last clean cut among them): a U+FFFD older than that is
        an invalid sequence no token completes (random weights write such bytes), and it is shown as
        it comes, so text never waits for the end of the generation and decode windows stay short."""
        end = len(self._ids)
        if not self._decode(self._ids[self._prefix : end]).endswith(REPLACEMENT_CHAR):
            return end
        for cut in range(end - 1, max(self._read, end - MAX_PARTIAL) - 1, -1):
            if cut > self._read and not self._decode(self._ids[self._prefix : cut]).endswith(REPLACEMENT_CHAR):
                return cut
        return max(self._read, end - MAX_PARTIAL)


class StopMatcher:
    """Cuts the output at the first stop string and holds back a tail that could begin one.

    Text pushed with ``armed=False`` (the text of the first min_tokens tokens) cannot end a stop
    string, as in vLLM: a stop string counts only if its last character comes after that text (it may
    begin inside it)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self._guarded = 0  # characters at the start of _held that came with armed=False
        self.stopped = False

    def push(self, text: str, armed: bool = True) -> str:
        """Text safe to emit now. Sets ``stopped`` (and drops the stop string and the rest) on a match."""
        if self.stopped or not text:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        guarded = self._guarded if armed else len(buf)  # disarmed text only ever comes first
        # the first occurrence of each stop that ends past the guarded text
        found = (buf.find(s, max(0, guarded - len(s) + 1)) for s in self._stops)
        cut = min((i for i in found if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held, self._guarded = "", 0
            return buf[:cut]
        keep = self._partial_suffix(buf)
        emitted = len(buf) - keep
        self._held = buf[emitted:]
        self._guarded = max(0, guarded - emitted)
        return buf[:emitted]

    def flush(self) -> str:
        out, self._held, self._guarded = self._held, "", 0
        return "" if self.stopped else out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        longest = max(len(s) for s in self._stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
