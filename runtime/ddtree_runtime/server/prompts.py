"""Chat prompts: the model's own template over the conversation and tools, tokenized so that no text a
client wrote can become a control token.

A user who writes ``<|im_end|>\n<|im_start|>assistant\n`` must not close their own turn and write the
assistant's, nor a tool result close its ``<tool_response>`` early. Before the template runs, the text
of every added token of the tokenizer (special or not: ``<tool_call>`` and ``<think>`` are not special
in every Qwen tokenizer, and match as tokens all the same) inside a client's strings (message content,
names, tool calls and definitions, template variables) is swapped for an escape: a private-use
character, ESCAPE, followed by the token's code character. A client's own ESCAPE is escaped too (doubled),
so no client text can pose as an escape. After rendering, each escape is tokenized as the plain text it
stands for, without matching any added token. Templates see the conversation unchanged but for those
tokens, and a request without them is tokenized exactly as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.server.errors import APIError
from ddtree_runtime.server.output_parsers import THINK_END, ToolCallParser, prompt_opens_thinking
from ddtree_runtime.server.schemas import ChatCompletionRequest

# Plane 16 private use: no tokenizer gives these meaning, and no chat template touches them. ESCAPE
# starts every escape; the character after it says what it stands for (ESCAPE itself, or token i).
ESCAPE = chr(0x100000)
CODE_BASE = 0x100001
# What closes a reasoning block the template opened, when the server starts the reply with a tool call.
CLOSE_THINKING = f"\n{THINK_END}\n\n"


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    opens_thinking: bool  # the reply starts inside <think> (the template opened it)
    opening: str  # the reply's first text, written by the server (a forced tool call's opening)


class ControlTokens:
    """One tokenizer's added tokens, and how to keep them out of client text."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        added = set(tokenizer.all_special_tokens)
        added |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
        self.texts = sorted(added, key=len, reverse=True)  # longest first: one may contain another
        escapes = {ESCAPE: ESCAPE + ESCAPE} | {text: ESCAPE + chr(CODE_BASE + i) for i, text in enumerate(self.texts)}
        self._escape = escapes
        self._text_of = {code[1]: text for text, code in escapes.items()}
        self._any = re.compile("|".join(re.escape(t) for t in escapes))
        self._escaped = re.compile(f"{ESCAPE}(.)", re.DOTALL)
        # the most characters one token covers: a text of more than n times that is more than n tokens
        self.longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1) if hasattr(
            tokenizer, "get_vocab") else 1

    def defuse(self, value: Any) -> Any:
        """`value` (strings, lists and dicts of them) with each added token's text, and ESCAPE, escaped."""
        if isinstance(value, str):
            return self._any.sub(lambda m: self._escape[m.group(0)], value)
        if isinstance(value, list):
            return [self.defuse(item) for item in value]
        if isinstance(value, dict):
            return {self.defuse(key): self.defuse(item) for key, item in value.items()}
        return value

    def check_fits(self, text: str, max_tokens: int, param: str) -> None:
        """A 400 before tokenizing when `text` has more characters than `max_tokens` tokens can cover
        (a 4 MiB body against a 2k context is refused at once, not after a million tokens)."""
        if len(text) > max_tokens * self.longest_token:
            raise APIError(400, f"{param}: {len(text)} characters cannot fit in this model's context of "
                           f"{max_tokens + 1} tokens (no token is longer than {self.longest_token} characters)",
                           param=param, code="context_length_exceeded")

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: the template's own added tokens as such, each escape as the
        plain text it stands for."""
        tok = self._tokenizer
        if ESCAPE not in text:
            return list(tok.encode(text, add_special_tokens=False))
        ids: list[int] = []
        for i, piece in enumerate(self._escaped.split(text)):
            if i % 2:  # a code character: what the escape stands for
                ids += self._plain(self._text_of.get(piece, ESCAPE + piece))
            elif piece:
                ids += tok.encode(piece, add_special_tokens=False)
        return ids

    def _plain(self, text: str) -> list[int]:
        """`text` tokenized as plain text: the tokenizer's model alone, no added token matched."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: splitting the special ones is all it offers
            return self._tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


def render_chat(tokenizer: Any, controls: ControlTokens, req: ChatCompletionRequest, template_defaults: dict,
                tool_parser: type[ToolCallParser] | None, max_tokens: int | None = None) -> ChatPrompt:
    """The prompt for a chat request: the template's rendering of the conversation and offered tools,
    then, when tool_choice requires a call, the call's opening (so the reply is one). A rendering far
    longer than `max_tokens` tokens could be is refused before it is tokenized."""
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
    if max_tokens is not None:
        controls.check_fits(text, max_tokens, "messages")
    return ChatPrompt(controls.encode(text), opens_thinking, opening)
