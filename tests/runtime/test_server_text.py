"""Unit tests for streaming text: incremental UTF-8 decoding and stop strings (no engine needed)."""

from __future__ import annotations

import random

import pytest

from ddtree_runtime.server.detok import IncrementalDecoder, StopMatcher


class ByteTokenizer:
    """One token per UTF-8 byte; id 256 is a special token (skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _stream(text: str, chunks: list[int], stops: list[str]) -> tuple[list[str], bool]:
    ids = list(text.encode()) + [256]
    dec, stop = IncrementalDecoder(ByteTokenizer()), StopMatcher(stops)
    pieces, i = [], 0
    for n in chunks:
        pieces.append(stop.push(dec.push(ids[i : i + n])))
        i += n
        if stop.stopped:
            return pieces, True
    pieces.append(stop.push(dec.push(ids[i:])))
    pieces.append(stop.push(dec.flush()) + stop.flush())
    return pieces, stop.stopped


TEXT = "héllo wörld — 数字 🙂 done"


@pytest.mark.parametrize("seed", range(20))
def test_multi_token_rounds_never_split_a_character(seed):
    rng = random.Random(seed)
    chunks = [rng.randint(1, 4) for _ in range(40)]
    pieces, stopped = _stream(TEXT, chunks, [])
    assert not stopped
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("seed", range(20))
def test_stop_string_is_cut_and_never_leaks(seed):
    rng = random.Random(seed)
    chunks = [rng.randint(1, 4) for _ in range(40)]
    pieces, stopped = _stream(TEXT, chunks, ["🙂 do", "zzz"])
    assert stopped
    assert "".join(pieces) == "héllo wörld — 数字 "
    # a held-back partial match is not shown before the decision
    assert all("🙂" not in p for p in pieces)


def test_partial_stop_that_does_not_complete_is_released():
    stop = StopMatcher(["abc"])
    assert stop.push("xxab") == "xx"
    assert stop.push("x") == "abx"
    assert stop.push("a") == ""
    assert stop.flush() == "a"
    assert not stop.stopped


def test_earliest_of_several_stops_wins():
    stop = StopMatcher(["world", "lo w"])
    assert stop.push("hello world") == "hel"
    assert stop.stopped


def test_incomplete_character_at_the_very_end_is_flushed():
    dec = IncrementalDecoder(ByteTokenizer())
    assert dec.push(list("ok".encode()) + [0xF0, 0x9F]) == "ok"  # the rest is held: it may complete
    assert dec.flush() == "\ufffd"


def test_a_stop_string_must_end_after_the_guarded_text():
    """min_tokens as vLLM applies it to stop strings: one that ends in the first tokens' text does not
    count (not even later); one that begins there and ends after it does."""
    m = StopMatcher(["e"])
    pieces = [(" is", False), (" Lee", False), (", and", False), (" I'm", True), (" a", True), (" student", True)]
    assert "".join(m.push(text, armed) for text, armed in pieces) == " is Lee, and I'm a stud" and m.stopped
    m = StopMatcher(["ab"])
    assert m.push("xa", armed=False) + m.push("b c") == "x" and m.stopped
    m = StopMatcher(["abc"])
    assert m.push("xab", armed=False) + m.push("d") + m.flush() == "xabd" and not m.stopped


class RecordingTokenizer(ByteTokenizer):
    """Records how many ids each decode is asked for."""

    def __init__(self) -> None:
        self.windows: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.windows.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_invalid_bytes_stream_out_instead_of_waiting_for_the_end():
    """Bytes no later token can complete (random weights write them) are shown as U+FFFD as they come,
    not held to the end of the generation, and each decode stays a short window."""
    tok = RecordingTokenizer()
    dec = IncrementalDecoder(tok)
    shown = [dec.push([0xFF, 0x80 + i % 32]) for i in range(200)]  # never valid UTF-8
    assert sum(1 for piece in shown if piece) >= 190
    assert max(tok.windows) <= 8
    sent = bytes(b for i in range(200) for b in (0xFF, 0x80 + i % 32))
    assert "".join(shown) + dec.flush() == sent.decode("utf-8", errors="replace")


def test_a_character_split_after_invalid_bytes_still_waits_for_its_end():
    dec = IncrementalDecoder(ByteTokenizer())
    # the last tokens are held (they may carry the lead of a character), the older invalid bytes shown
    assert dec.push([0xFF] * 5 + list("é".encode())[:1]) == "\ufffd" * 3
    assert dec.push(list("é".encode())[1:]) == "\ufffd" * 2 + "é"
