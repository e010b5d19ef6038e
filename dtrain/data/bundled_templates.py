"""The chat templates dtrain bundles: common models' own templates with the assistant's output in
`{% generation %}` blocks (dtrain/data/assets/chat_templates/<name>.jinja), so that the trained tokens come from
the template itself, as transformers' `return_assistant_tokens_mask` takes them.

Released tokenizers ship their template without those blocks. A model's template is matched to a bundled one by
what it writes, not by its source (the same template is published with different whitespace and line breaks): both
render the PROBES alike. Each row is then rendered by the model's own template (its ids stay transformers') and
by the bundled one, which marks the assistant's spans when it writes the very same text.

- llama3: Meta-Llama-3-8B-Instruct's (header, answer trimmed, <|eot_id|>).
- qwen2.5: Qwen2.5-Instruct's, tool calls and tool results included.
- qwen3: Qwen3's, with its <think> blocks, tool calls and tool results.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

FOLDER = os.path.join(os.path.dirname(__file__), "assets", "chat_templates")


def bundled_names() -> list[str]:
    return sorted(name.removesuffix(".jinja") for name in os.listdir(FOLDER) if name.endswith(".jinja"))


def bundled_file(name: str) -> str | None:
    path = os.path.join(FOLDER, f"{name}.jinja")
    return path if name in bundled_names() else None


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
# Conversations (messages, tools) that tell the templates apart: several turns with a system prompt, reasoning, and
# tool calls (with and without content) and their results.
PROBES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": " Hello. "}, {"role": "user", "content": "2 + 2?"},
      {"role": "assistant", "content": "4", "reasoning_content": "Add."}], None),
    ([{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": None, "tool_calls": [_call("add", a=1, b=2)]},
      {"role": "tool", "content": "3"}, {"role": "assistant", "content": "Adding.", "tool_calls": [_call("add", a=3, b=0)]},
      {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}], _TOOLS),
]


class Renders(Protocol):
    def render(self, messages: list[dict[str, Any]], where: str, add_generation_prompt: bool = False,
               spans: Any = None, tools: Any = None) -> str: ...


def _outcome(template: Renders, messages: list[dict[str, Any]], tools: Any, prompt: bool) -> str | None:
    from dtrain.errors import DataError

    try:
        return template.render(messages, "a probe", add_generation_prompt=prompt, tools=tools)
    except DataError:  # refusing a probe is part of what a template does: the other must refuse it too
        return None


def renders_alike(model: Renders, bundled: Renders) -> bool:
    """Whether the two templates write the same text for every probe and each probe's first turns (None when
    both refuse it), with the generation prompt and without."""
    for messages, tools in PROBES:
        for end in range(1, len(messages) + 1):
            for prompt in (False, True):
                if _outcome(model, messages[:end], tools, prompt) != _outcome(bundled, messages[:end], tools, prompt):
                    return False
    return True
