"""Request bodies for the OpenAI endpoints, validated into 400s with OpenAI-style error objects.

Unknown fields are ignored (clients send many optional ones); fields we cannot honour with a non-default
value are rejected rather than silently ignored. Types are strict: ``max_tokens: true`` or
``temperature: "1"`` is a 400, never coerced.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from ddtree_runtime.server.errors import APIError, encodable

MAX_STOP_STRINGS = 16
# Template variables are flags and short values; anything deeper is refused before a template recurses
# through it (Jinja hits Python's recursion limit long before JSON's parser does).
MAX_TEMPLATE_VALUE_DEPTH = 16
# apply_chat_template's own arguments: chat_template_kwargs may only set template variables.
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


class SpeculativeOptions(BaseModel):
    """Per-request override: ``{"speculative": {"mode": "ar", "tree_budget": 8}}``."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["ddtree", "dflash", "ar"] | None = None
    tree_budget: StrictInt | None = Field(default=None, ge=1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch's generators accept
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    logprobs: Any = None
    best_of: StrictInt | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only best_of=1 is supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported, got type {self.type!r}")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        clash = sorted(set(v or ()) & RESERVED_TEMPLATE_ARGS)
        if clash:
            raise ValueError(f"{clash[0]!r} is not a chat template variable")
        for name, value in (v or {}).items():
            if _depth(value) > MAX_TEMPLATE_VALUE_DEPTH:
                raise ValueError(f"{name!r} nests deeper than {MAX_TEMPLATE_VALUE_DEPTH} levels")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tools are not supported")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template expects them (``developer`` is the newer name for ``system``)."""
        out = []
        for m in self.messages:
            msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


class CompletionRequest(_Sampling):
    # A string, a list of token ids, or a one-element list of either (batched prompts are not supported).
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: StrictStr | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in a JSON value (a scalar is 0). Iterative: it may be deep."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, level = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level + 1)
            pending.extend((child, level + 1) for child in children)
    return deepest


def parse_body(raw: bytes) -> dict:
    """The request's JSON object; a 400 naming the field for what json.loads accepts but no client
    means: nesting deeper than the parser's recursion limit, and lone surrogates (``"\\ud800"``),
    which no tokenizer can encode and no response can echo."""
    try:
        text = raw.decode(json.detect_encoding(raw))
        body = json.loads(text)
    except RecursionError:
        field = _too_deep_field(text)
        raise APIError(400, f"{field or 'request body'}: JSON nested too deeply", param=field) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    where = _lone_surrogate_at(body)
    if where is not None:
        raise APIError(400, f"{where or 'request body'}: text holds a lone UTF-16 surrogate (not a character)",
                       param=where or None)
    return body


def _too_deep_field(text: str) -> str | None:
    """The top-level field whose value nests too deeply (each value re-parsed on its own), or None."""
    decoder, skip = json.JSONDecoder(), json.decoder.WHITESPACE.match
    at = skip(text, 0).end()
    if not text.startswith("{", at):
        return None
    at += 1
    while True:
        at = skip(text, at).end()
        if not text.startswith('"', at):
            return None
        key, at = json.decoder.scanstring(text, at + 1)
        at = skip(text, at).end()
        if not text.startswith(":", at):
            return None
        try:
            _, at = decoder.raw_decode(text, skip(text, at + 1).end())
        except RecursionError:
            return key
        except ValueError:
            return None
        at = skip(text, at).end()
        if not text.startswith(",", at):
            return None
        at += 1


def _lone_surrogate_at(body: Any) -> str | None:
    """Where the first string (key or value) holding a lone surrogate is, as a param path
    ('messages[0].content'; '' for the body itself), or None. Iterative: the body may nest deeply."""
    pending: list[tuple[str, Any]] = [("", body)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if _has_lone_surrogate(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if _has_lone_surrogate(key):
                    key = encodable(key)  # the path is quoted in the error
                    return f"{path}.{key}" if path else key
                child = f"{path}.{key}" if path else key
                pending.append((child, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def _has_lone_surrogate(text: str) -> bool:
    # json.loads pairs valid surrogate escapes into one code point: any surrogate left is alone
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def validate(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        # Our own checks say the most; else the deepest error ([true] as a token list: "prompt[0]: a
        # valid integer", not the string branch's "prompt: a valid string").
        first = next((e for e in errors if e.get("type") == "value_error"), None) or max(
            errors, key=lambda e: len(_param_name(e.get("loc", ()))))
        param = _param_name(first.get("loc", ()))
        message = first.get("msg", "invalid value")
        message = message.removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param or None) from None


# The labels pydantic puts in an error's location for the branch of a union that failed ('str', 'int',
# 'list[int]', 'function-after[...]'): not field names.
_UNION_BRANCHES = frozenset({"str", "int", "float", "bool"})


def _param_name(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; drops pydantic's union-branch labels."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and (part in _UNION_BRANCHES or "[" in part):
            continue
        else:
            out += f".{part}" if out else part
    return out
