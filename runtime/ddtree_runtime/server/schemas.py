"""Request bodies for the OpenAI endpoints, validated into 400s with OpenAI-style error objects.

Every field of OpenAI's and vLLM's chat and completions requests is either honoured or refused: the
sampling fields that keep speculative decoding exact (they change the target's distribution the same
way at every tree node) are honoured; a field this server cannot honour is a 400 naming it, unless it
holds its default (``presence_penalty: 0`` is fine, ``0.5`` is not). Names neither API defines are
ignored, as vLLM ignores them. Types are strict: ``max_tokens: true`` or ``temperature: "1"`` is a
400, never coerced.
"""

from __future__ import annotations

import json
import re
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

from ddtree_runtime.limits import MAX_LOGPROBS, MODES
from ddtree_runtime.server.errors import APIError, encodable

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's limit on biased tokens
MAX_TOOLS = 128  # OpenAI's limit
# Template variables are flags and short values; anything deeper is refused before a template recurses
# through it (Jinja hits Python's recursion limit long before JSON's parser does).
MAX_TEMPLATE_VALUE_DEPTH = 16
# apply_chat_template's own arguments: chat_template_kwargs may only set template variables.
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for function names
# A logit_bias key: a token id in ASCII digits (str.isdigit also accepts "²", which int() refuses), short
# enough that int() never meets Python's digit limit; ids past the vocabulary are refused later.
TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
# How deeply an earlier tool call's arguments may nest: the template renders them recursively.
MAX_ARGUMENT_DEPTH = 2 * MAX_TEMPLATE_VALUE_DEPTH

# Fields of OpenAI's and vLLM's requests that this server does not honour, each with the values that
# mean "not used" (sent by clients that fill in defaults). Anything else is a 400 naming the field.
_PATH_DEPENDENT = "depends on the tokens before it on each tree path, which speculative decoding does not track"
_UNHONOURED: dict[str, tuple[tuple, str]] = {
    "presence_penalty": ((0, 0.0), _PATH_DEPENDENT),
    "frequency_penalty": ((0, 0.0), _PATH_DEPENDENT),
    "repetition_penalty": ((1, 1.0), _PATH_DEPENDENT),
    "prompt_logprobs": ((0,), "log-probabilities of prompt tokens are not returned by this server"),
    "best_of": ((1,), "only one sequence is generated per request"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "beam search is not supported"),
    "response_format": (({"type": "text"},), "structured output is not supported"),
    "guided_json": ((), "structured output is not supported"),
    "guided_regex": ((), "structured output is not supported"),
    "guided_choice": ((), "structured output is not supported"),
    "guided_grammar": ((), "structured output is not supported"),
    "guided_decoding_backend": ((), "structured output is not supported"),
    "guided_whitespace_pattern": ((), "structured output is not supported"),
    "structured_outputs": ((), "structured output is not supported"),
    "allowed_token_ids": ((), "token allow-lists are not supported"),
    "bad_words": (([],), "bad-word lists are not supported"),
    "include_stop_str_in_output": ((False,), "stop strings are always cut from the output"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer joins them"),
    "truncate_prompt_tokens": ((), "prompts are never truncated: a prompt too long is a 400"),
    "prompt_embeds": ((), "prompt embeddings are not supported"),
    "logits_processors": ((), "custom logits processors are not supported"),
    "return_tokens_as_token_ids": ((False,), "tokens are returned as text"),
    "chat_template": ((), "the model's own chat template is used; a client's template is not run"),
    "add_generation_prompt": ((True,), "the assistant's turn is always opened"),
    "continue_final_message": ((False,), "continuing the final message is not supported"),
    "documents": ((), "documents are not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only text output is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "the reasoning effort is not adjustable; use chat_template_kwargs"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "completions are not stored"),
    "parallel_tool_calls": ((True,), "every tool call the model writes is returned"),
    "functions": ((), "the deprecated functions field is not supported; use tools"),
    "function_call": ((), "the deprecated function_call field is not supported; use tool_choice"),
    "echo": ((False,), "echo is not supported"),
    "suffix": (("",), "suffix is not supported"),
}


def refuse_unhonoured(body: dict) -> None:
    """A 400 naming the first field this server cannot honour that holds more than its default."""
    for name, (defaults, why) in _UNHONOURED.items():
        if name in body and body[name] is not None and not _is_default(body[name], defaults):
            raise APIError(400, f"{name}: not supported: {why}", param=name)


def _is_default(value: Any, defaults: tuple) -> bool:
    # bool is an int in Python: `logprobs: false` is a default, `presence_penalty: false` is not a number
    return any(value == d and type(value) is type(d) or (type(d) in (int, float) and type(value) in (int, float)
                                                         and value == d) for d in defaults)


class SpeculativeOptions(BaseModel):
    """Per-request override: ``{"speculative": {"mode": "ar", "tree_budget": 8}}``."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal[MODES] | None = None  # the engine's modes (limits.MODES, engine/modes.py)
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
    top_k: StrictInt | None = Field(default=None, ge=-1)  # vLLM: -1 or 0 = all tokens
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    logit_bias: dict[str, StrictFloat] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt | None = Field(default=None, ge=0)  # vLLM's: no stop token before this many
    skip_special_tokens: StrictBool = True
    seed: StrictInt | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch's generators accept
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    user: StrictStr | None = None  # who asked: nothing to honour, accepted as OpenAI accepts it

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased")
        for key, bias in v.items():
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"keys are token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"token {key}: a bias must be between -100 and 100, got {bias}")
        return v

    @model_validator(mode="after")
    def _min_below_max(self) -> "_Sampling":
        limit = self.requested_max_tokens()
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            raise APIError(400, f"min_tokens: {self.min_tokens} is more than the {limit} tokens asked for at most",
                           param="min_tokens")
        return self

    def requested_logprobs(self) -> int | None:
        """How many most likely tokens to return beside each chosen token's log-probability; None: no
        log-probabilities at all."""
        return None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_bias(self) -> dict[int, float]:
        return {int(key): float(bias) for key, bias in (self.logit_bias or {}).items()}

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


class FunctionCall(BaseModel):
    """A call the assistant made earlier in the conversation; `arguments` is a JSON object's text."""

    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    arguments: StrictStr

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            parsed = json.loads(v)
        except RecursionError:
            raise ValueError(f"nests deeper than {MAX_ARGUMENT_DEPTH} levels") from None
        except ValueError:
            raise ValueError("must be a JSON object's text") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object's text")
        if _depth(parsed) > MAX_ARGUMENT_DEPTH:
            raise ValueError(f"nests deeper than {MAX_ARGUMENT_DEPTH} levels")
        return v


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    reasoning_content: StrictStr | None = None

    @model_validator(mode="after")
    def _calls_are_the_assistants(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not FUNCTION_NAME.fullmatch(v):
            raise ValueError("must be 1-64 letters, digits, '_', '.' or '-'")
        return v

    @field_validator("parameters")
    @classmethod
    def _shallow(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and _depth(v) > 2 * MAX_TEMPLATE_VALUE_DEPTH:  # a schema nests twice per level
            raise ValueError(f"nests deeper than {2 * MAX_TEMPLATE_VALUE_DEPTH} levels")
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_dict(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

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
    def _distinct_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in v or ()]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:
            raise ValueError(f"two tools are named {twice!r}")
        return v

    @model_validator(mode="after")
    def _choice_needs_tools(self) -> "ChatCompletionRequest":
        choice = self.tool_choice
        names = {t.function.name for t in self.tools or ()}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice: no tool named {choice.function.name!r} is in tools",
                           param="tool_choice")
        if choice == "required" and not names:
            raise APIError(400, "tool_choice: 'required' needs a non-empty tools list", param="tool_choice")
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def offered_tools(self) -> list[Tool]:
        """The tools the model sees and may call: none with tool_choice "none"."""
        return [] if self.tool_choice == "none" else list(self.tools or ())

    def forced_function(self) -> str | None:
        """The function tool_choice names, if it names one."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: ``developer`` is the newer name for ``system``;
        a tool call's arguments are an object (Qwen's templates iterate over them), not JSON text."""
        out = []
        for m in self.messages:
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                    for c in m.tool_calls
                ]
            out.append(msg)
        return out


class CompletionRequest(_Sampling):
    # A string, a list of token ids, or a one-element list of either (batched prompts are not supported).
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    # the legacy API's form: the chosen token's log-probability and the `logprobs` most likely tokens'
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

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
    refuse_unhonoured(body)
    try:
        return model.model_validate(body)
    except RecursionError:  # a backstop: every field that may nest is bounded before anything recurses
        raise APIError(400, "request body: nests too deeply") from None
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
