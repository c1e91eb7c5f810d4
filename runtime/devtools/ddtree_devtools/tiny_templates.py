"""The tiny models' chat templates, one per target family, in the style of the real Qwen templates.

Both render the conversation as Qwen3 does (ChatML turns; tool results grouped into one user turn of
``<tool_response>`` blocks; earlier assistant turns without their reasoning) and differ where the real
families differ: how a tool call is written (Qwen3: hermes JSON; Qwen3.5/3.6: ``<function=...>``
with ``<parameter=...>`` blocks) and how thinking opens (Qwen3.5's generation prompt opens the
``<think>`` block itself). The tools block is shorter than the real one (one JSON line per function
after a ``# Tools`` heading, without the real templates' paragraph of instructions) so that a whole
tool-use conversation fits the tiny models' 64-token training windows. Thinking is off unless the
request sets ``enable_thinking`` (the tiny models were first trained that way, and their smoke prompts
rely on it).
"""

from __future__ import annotations

_SYSTEM_AND_TOOLS = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' -}}{{- (tool.function if tool.function is defined else tool) | tojson -}}"
    "{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
)

_HERMES_CALL = (
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' -}}"
    "{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
)

_CODER_CALL = (
    "{{- '<tool_call>\\n<function=' + call.name + '>\\n' -}}"
    "{%- for key, value in call.arguments.items() -%}"
    "{{- '<parameter=' + key + '>\\n' -}}"
    "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}"
    "{{- '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}"
)


def _template(call: str, thinking_on: str) -> str:
    return (
        _SYSTEM_AND_TOOLS
        + "{%- for message in messages -%}"
        "{%- if message.role == 'system' -%}"
        "{%- if not loop.first -%}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- elif message.role == 'user' -%}"
        "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' -}}"
        "{%- elif message.role == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' + (message.content or '') -}}"
        "{%- for tool_call in message.tool_calls or [] -%}"
        "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
        "{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}"
        + call
        + "{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- elif message.role == 'tool' -%}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- if enable_thinking is defined and enable_thinking -%}"
        + thinking_on
        + "{%- else -%}"
        "{{- '<think>\\n\\n</think>\\n\\n' -}}"
        "{%- endif -%}"
        "{%- endif -%}"
    )


CHAT_TEMPLATES = {
    # Qwen3: the model opens <think> itself when thinking is on
    "qwen3": _template(_HERMES_CALL, ""),
    # Qwen3.5/3.6: the generation prompt opens <think> when thinking is on
    "qwen3_5": _template(_CODER_CALL, "{{- '<think>\\n' -}}"),
}
