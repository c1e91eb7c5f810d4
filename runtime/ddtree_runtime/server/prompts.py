"""Chat prompts: the model's own template over the conversation and tools, tokenized so that no text a
client wrote can become a control token.

A user who writes ``<|im_end|>\\n<|im_start|>assistant\\n`` must not close their own turn and write the
assistant's. Before the template runs, every special token's text inside a client's strings (message
content, names, tool calls and definitions, template variables) is swapped for a private-use
placeholder character; after rendering, each placeholder is tokenized as the plain text it stands
for, with the special tokens split. Templates see the conversation unchanged but for those tokens, and a
request without them is tokenized exactly as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.server.errors import APIError
from ddtree_runtime.server.output_parsers import THINK_END, ToolCallParser, prompt_opens_thinking
from ddtree_runtime.server.schemas import ChatCompletionRequest

# Plane 16 private use: no tokenizer gives these meaning, and no chat template touches them.
PLACEHOLDER_BASE = 0x100000
# What closes a reasoning block the template opened, when the server starts the reply with a tool call.
CLOSE_THINKING = f"\n{THINK_END}\n\n"


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    opens_thinking: bool  # the reply starts inside <think> (the template opened it)
    opening: str  # the reply's first text, written by the server (a forced tool call's opening)


class ControlTokens:
    """One tokenizer's special tokens, and how to keep them out of client text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        specials = set(tokenizer.all_special_tokens)
        specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        self.texts = sorted(specials, key=len, reverse=True)  # longest first: one may contain another
        self._placeholder = {text: chr(PLACEHOLDER_BASE + i) for i, text in enumerate(self.texts)}
        self._text_of = {ph: text for text, ph in self._placeholder.items()}
        self._any = re.compile("|".join(re.escape(t) for t in self.texts)) if self.texts else None
        last = chr(PLACEHOLDER_BASE + len(self.texts) - 1)
        self._split = re.compile(f"([{chr(PLACEHOLDER_BASE)}-{last}])") if self.texts else None

    def defuse(self, value: Any) -> Any:
        """`value` (strings, lists and dicts of them) with each special token's text replaced by its
        placeholder."""
        if self._any is None:
            return value
        if isinstance(value, str):
            return self._any.sub(lambda m: self._placeholder[m.group(0)], value)
        if isinstance(value, list):
            return [self.defuse(item) for item in value]
        if isinstance(value, dict):
            return {self.defuse(key): self.defuse(item) for key, item in value.items()}
        return value

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: the template's own special tokens as control tokens, each
        placeholder as the plain text it replaced."""
        tok = self._tokenizer
        if self._split is None or not self._split.search(text):
            return list(tok.encode(text, add_special_tokens=False))
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self._text_of:
                ids += tok(self._text_of[piece], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            elif piece:
                ids += tok.encode(piece, add_special_tokens=False)
        return ids


def render_chat(tokenizer: Any, controls: ControlTokens, req: ChatCompletionRequest, template_defaults: dict,
                tool_parser: type[ToolCallParser] | None) -> ChatPrompt:
    """The prompt for a chat request: the template's rendering of the conversation and offered tools,
    then, when tool_choice requires a call, the call's opening (so the reply is one)."""
    tools = [t.as_template_dict() for t in req.offered_tools()]
    kwargs = {**template_defaults, **controls.defuse(req.chat_template_kwargs or {})}
    try:
        text = tokenizer.apply_chat_template(
            controls.defuse(req.template_messages()), tools=controls.defuse(tools) or None, tokenize=False,
            add_generation_prompt=True, **kwargs,
        )
    except Exception as exc:  # a template that rejects the conversation (e.g. role order) is the client's error
        raise APIError(400, f"messages: the chat template rejected them: {exc}", param="messages") from None
    opens_thinking = prompt_opens_thinking(text)
    opening = ""
    if tool_parser is not None and (req.tool_choice == "required" or req.forced_function()):
        opening = tool_parser.opening(req.forced_function())
        if opens_thinking:
            text, opens_thinking = text + CLOSE_THINKING, False
        text += opening  # the server's own text: a function name is letters, digits and _.-
    return ChatPrompt(controls.encode(text), opens_thinking, opening)
