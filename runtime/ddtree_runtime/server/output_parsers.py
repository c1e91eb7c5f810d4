"""What the model writes, split into reasoning, answer and tool calls as its text streams in.

Qwen3-family models think inside ``<think>...</think>`` before answering and call tools inside
``<tool_call>...</tool_call>``, in one of two forms named as SGLang names its parsers:

- ``hermes`` (Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5/3.6): ``<tool_call><function=NAME><parameter=P>value</parameter>
  ...</function></tool_call>``, the values typed by the tool's JSON schema.

Each parser takes text pieces as the detokenizer releases them and returns what can be shown now. A tail
that might be the start of a tag is held back until the next piece decides it, so a tag split across
rounds (or characters) never reaches the client half-written. A tool call is released only once it is
complete and well-formed; anything malformed comes back as plain content, never as an error (nor
as an exception: a client can steer the model into writing JSON nested past the parser's recursion
limit, so every parse treats RecursionError as malformed).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the rendered prompt leaves a ``<think>`` open: the template started the reasoning
    (Qwen3.5/3.6 in thinking mode end the generation prompt with ``<think>\\n``), so the model's first
    words are reasoning although it never writes the opening tag."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ReasoningParser:
    """``--reasoning-parser qwen3``: text inside ``<think>...</think>`` at the start of the reply is
    reasoning; the rest is the answer. Only the reply's start can open a think block, as in Qwen3."""

    def __init__(self, starts_inside: bool = False) -> None:
        self._inside = starts_inside
        self._undecided = not starts_inside  # may the reply still open with <think>?
        self._fresh = True  # strip the newlines that follow a tag
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be shown now."""
        buf = self._held + text
        self._held = ""
        reasoning = content = ""
        if self._undecided:
            head = buf.lstrip()
            if head.startswith(THINK_START):
                self._undecided, self._inside, self._fresh = False, True, True
                buf = head[len(THINK_START):]
            elif THINK_START.startswith(head):  # blank, or a prefix of the tag: wait and see
                self._held = buf
                return "", ""
            else:
                self._undecided = False
        if self._inside:
            end = buf.find(THINK_END)
            if end < 0:
                keep = partial_tag_len(buf, THINK_END)
                self._held = buf[len(buf) - keep:] if keep else ""
                return self._reasoning_piece(buf[:len(buf) - keep]), ""
            reasoning = self._reasoning_piece(buf[:end])
            self._inside, self._fresh = False, True
            buf = buf[end + len(THINK_END):]
        if self._fresh:
            buf = buf.lstrip("\n")
            if not buf:
                return reasoning, ""
            self._fresh = False
        content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, now that the reply is over (an unclosed think block stays reasoning)."""
        held, self._held = self._held, ""
        if self._inside:
            return self._reasoning_piece(held), ""
        return "", "" if self._undecided and not held.strip() else held

    def _reasoning_piece(self, text: str) -> str:
        if self._fresh:
            text = text.lstrip("\n")
            self._fresh = not text
        return text


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallParser:
    """Splits the answer into content and complete tool calls; subclasses parse one call's body.

    `tools` maps each offered function's name to its JSON-schema `parameters`; a call naming any other
    function is not a call but content."""

    tools: dict[str, dict]
    make_id: Callable[[], str] = new_call_id
    calls: list[ToolCall] = field(default_factory=list, init=False)
    _held: str = field(default="", init=False)
    _in_call: bool = field(default=False, init=False)

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls completed by this piece)."""
        buf, self._held = self._held + text, ""
        content: list[str] = []
        new: list[ToolCall] = []
        while True:
            if not self._in_call:
                start = buf.find(CALL_START)
                if start < 0:
                    keep = partial_tag_len(buf, CALL_START)
                    content.append(self._between_calls(buf[:len(buf) - keep]))
                    self._held = buf[len(buf) - keep:] if keep else ""
                    break
                content.append(self._between_calls(buf[:start]))
                buf, self._in_call = buf[start + len(CALL_START):], True
            end = buf.find(CALL_END)
            if end < 0:
                self._held = buf
                break
            body, buf, self._in_call = buf[:end], buf[end + len(CALL_END):], False
            call = self._call(body)
            if call is None:
                content.append(CALL_START + body + CALL_END)
            else:
                new.append(call)
        return "".join(content), new

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held tail: an unfinished call was not a call, so it goes back as text."""
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            held = CALL_START + held
        return self._between_calls(held), []

    def _between_calls(self, text: str) -> str:
        # the newlines a model writes between (or after) its calls are layout, not an answer
        return "" if self.calls and not text.strip() else text

    def _call(self, body: str) -> ToolCall | None:
        try:
            parsed = self.parse_body(body.strip())
            if parsed is None or parsed[0] not in self.tools:
                return None
            arguments = json.dumps(parsed[1], ensure_ascii=False)
        except (ValueError, RecursionError):  # the model's text, however deep, is never an error
            return None
        call = ToolCall(len(self.calls), self.make_id(), parsed[0], arguments)
        self.calls.append(call)
        return call

    def parse_body(self, body: str) -> tuple[str, dict] | None:
        """(function name, arguments) from the text between the call tags, or None if malformed."""
        raise NotImplementedError

    @classmethod
    def opening(cls, function: str | None) -> str:
        """The text a reply starts with when it must call a tool (`function`, or any if None), written
        as the model's chat template writes calls: the server puts it in the prompt and feeds it here."""
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (Qwen3, Hermes)."""

    def parse_body(self, body: str) -> tuple[str, dict] | None:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return None
        return (obj["name"], args) if isinstance(args, dict) else None

    @classmethod
    def opening(cls, function: str | None) -> str:
        if function is None:
            return CALL_START + "\n"
        return CALL_START + "\n" + '{"name": ' + json.dumps(function) + ', "arguments": '


class Qwen3CoderParser(ToolCallParser):
    """``<function=f><parameter=p>value</parameter>...</function>`` (Qwen3-Coder, Qwen3.5/3.6).

    Values are raw text; each is typed by the function's JSON schema (a string stays as written). A
    missing ``</parameter>`` ends the value at the next parameter or at ``</function>``, as models
    sometimes leave it out."""

    def parse_body(self, body: str) -> tuple[str, dict] | None:
        head, func_end = "<function=", "</function>"
        if not body.startswith(head) or not body.endswith(func_end):
            return None
        name, sep, rest = body[len(head):-len(func_end)].partition(">")
        name = name.strip()
        if not sep or not name or "\n" in name:
            return None
        props = self.tools.get(name, {}).get("properties", {}) or {}
        before_first, *chunks = rest.split("<parameter=")
        if before_first.strip():
            return None  # text between the function tag and its first parameter
        args: dict[str, Any] = {}
        for chunk in chunks:
            key, sep, value = chunk.partition(">")
            if not sep or not key.strip():
                return None
            value = value.split("</parameter>")[0]
            args[key.strip()] = _typed(_strip_one_newline(value), props.get(key.strip()))
        return name, args

    @classmethod
    def opening(cls, function: str | None) -> str:
        return CALL_START + "\n<function=" + ("" if function is None else function + ">\n")


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: dict | None) -> Any:
    """A parameter's text as the JSON type its schema asks for; the text itself when it does not parse."""
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    text = value.strip()
    if kind in (None, "string"):
        return value
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return value
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return value
        return int(number) if number.is_integer() and text.lstrip("-").isdigit() else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), value)
    if kind == "null":
        return None if text == "null" else value
    try:  # object, array
        return json.loads(text)
    except (ValueError, RecursionError):
        return value


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "qwen3_coder": Qwen3CoderParser}
REASONING_PARSERS = ("qwen3",)


@dataclass
class ReplyPiece:
    """What a piece of the reply adds: reasoning, answer text, tool calls completed."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ReplySplitter:
    """The reply's text through the reasoning parser (if any), then its answer through the tool-call
    parser (if any): reasoning never holds tool calls, as in SGLang and vLLM."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, opening: str = "") -> None:
        self._reasoning = reasoning
        self._tools = tools
        if opening and tools is not None:  # the forced call's start is in the prompt, not the reply
            tools.push(opening)

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def push(self, text: str) -> ReplyPiece:
        reasoning, content = self._reasoning.push(text) if self._reasoning else ("", text)
        return self._answer(reasoning, content, final=False)

    def finish(self) -> ReplyPiece:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._answer(reasoning, content, final=True)

    def _answer(self, reasoning: str, content: str, final: bool) -> ReplyPiece:
        if self._tools is None:
            return ReplyPiece(reasoning, content)
        content, calls = self._tools.push(content) if content else ("", [])
        if final:
            tail, more = self._tools.finish()
            content, calls = content + tail, calls + more
        return ReplyPiece(reasoning, content, calls)


def tool_schemas(tools: Iterable[dict]) -> dict[str, dict]:
    """name -> parameters schema, from an OpenAI `tools` list (``{"type": "function", "function": {...}}``)."""
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
