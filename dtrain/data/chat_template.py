"""Chat templates: a conversation becomes token ids, and a flag per id saying whether it is a trained target.

`JinjaChatTemplate` renders the model's own template (tokenizer_config.json's `chat_template`, or the
chat_template.jinja beside it) with jinja2 set up as transformers sets it up, and tokenizes the whole text once
without adding special tokens, so the ids are those of transformers' `apply_chat_template(messages,
tokenize=True)`. A token is a target when its characters overlap an assistant span (transformers' assistant
mask rule); the spans come from `{% generation %}` blocks, or else from rendering prefixes of the conversation
(docs/fine-tuning.md, "How an answer's tokens are found": the rule, tool calls, and what is refused).
tests/data/test_chat_template.py checks ids and masks against transformers for Llama 3, Qwen2.5 and Qwen3.

`PlainChatTemplate` is for tokenizers without a template (the byte tokenizer): BOS, then "User: ..." lines and
"Assistant: " followed by the answer and EOS; the answer and its EOS are the targets. It has no way to write tool
calls, so a turn with `tool_calls` is refused rather than trained without them.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import numpy as np

from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError, first_line

logger = logging.getLogger("dtrain")

Message = dict[str, Any]
# A row's tool definitions (JSON schemas, as OpenAI's `tools` and transformers' apply_chat_template take them).
Tools = list[dict[str, Any]] | None
# A character the template never sees otherwise (Unicode private use): appended to an assistant content to find
# where that content ends in the rendered text.
CONTENT_MARK = "\ue000"
PLAIN = "plain"
# Names of a message's reasoning, the standard one first (transformers' _REASONING_FIELDS).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers' test for a template that marks the assistant's text itself.
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class ChatTemplate(ABC):
    """Turns a conversation (OpenAI-style messages) into (ids int64[n], targets bool[n]); `where` names the row in
    errors."""

    description: str

    @abstractmethod
    def tokenize(
        self, messages: Sequence[Message], where: str, find_targets: bool = True, tools: Tools = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids of the conversation (with the row's `tools` offered to the model, as
        `apply_chat_template(..., tools=...)` gives them) and which of them are the assistant's (the trained
        targets); every one without `find_targets` (training on all tokens, where a template's turns need not be
        found)."""

    @abstractmethod
    def generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        """The ids of the conversation followed by the assistant's cue: what the model continues in a chat
        (`apply_chat_template(..., add_generation_prompt=True)`)."""


class PlainChatTemplate(ChatTemplate):
    """BOS, "System: ...\\n" / "User: ...\\n" / "Tool: ...\\n" lines, and "Assistant: " + answer + EOS."""

    description = 'plain template (BOS, "User: ..." lines, "Assistant: " + answer + EOS)'

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def tokenize(
        self, messages: Sequence[Message], where: str, find_targets: bool = True, tools: Tools = None
    ) -> tuple[np.ndarray, np.ndarray]:
        if tools:
            raise DataError(
                f"{where} offers tools, which the plain chat template cannot write; use a Hugging Face tokenizer "
                "whose chat template writes them (training.chat.chat_template)"
            )
        ids, targets = [self.tokenizer.bos_id], [not find_targets]
        for message in messages:
            role, content = message["role"], message["content"]
            if message.get("tool_calls"):
                raise DataError(
                    f"{where} makes tool calls, which the plain chat template cannot write; use a Hugging Face "
                    "tokenizer whose chat template writes tool_calls (training.chat.chat_template)"
                )
            if role == "assistant":
                head = self.tokenizer.encode("Assistant: ")
                answer = self.tokenizer.encode(content) + [self.tokenizer.eos_id]
                ids += head + answer
                targets += [not find_targets] * len(head) + [True] * len(answer)
            else:
                line = self.tokenizer.encode(f"{role.capitalize()}: {content}\n")
                ids += line
                targets += [not find_targets] * len(line)
        return np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=bool)

    def generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        ids = self.tokenize(messages, "the conversation", find_targets=False)[0].tolist()
        return ids + self.tokenizer.encode("Assistant: ")


def _environment() -> Any:
    """A jinja2 environment as transformers' `_compile_jinja_template` builds it, plus `track(spans)`, which
    records the character spans that `{% generation %}` blocks render while it is active."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise DataError(
            "a model's chat template needs jinja2: pip install jinja2 (or set training.chat.chat_template = plain)"
        ) from exc

    class GenerationSpans(jinja2.ext.Extension):
        # transformers' AssistantTracker: a {% generation %} block's output, located in what was rendered so far.
        tags = {"generation"}

        def __init__(self, environment: Any):
            super().__init__(environment)
            environment.extend(track=self.track)
            self._tracking: ContextVar = ContextVar("generation_spans", default=None)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller: Any) -> str:
            output = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(output)))
            return output

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationSpans, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class JinjaChatTemplate(ChatTemplate):
    """A Hugging Face chat template. `variables` are the special tokens' texts (bos_token, eos_token, ...);
    `special_tokens` the texts of the tokenizer's special tokens (an end-of-turn token after an answer is trained)."""

    def __init__(
        self, source: str, origin: str, tokenizer: Tokenizer, variables: dict[str, str], special_tokens: Sequence[str]
    ):
        import jinja2

        self.variables, self.origin = variables, origin
        # HFTokenizer's `tokenizers.Tokenizer` (its special tokens added): its encodings carry character offsets.
        self._rust_tokenizer = tokenizer._tokenizer
        self.special_tokens = sorted((t for t in special_tokens if t), key=len, reverse=True)
        self.env = _environment()
        try:
            self.template = self.env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise DataError(f"chat template {origin} does not compile: line {exc.lineno}: {exc.message}") from None
        self.marks_generation = GENERATION_TAG.search(source) is not None
        # A bundled template that writes what this one writes, with {% generation %} blocks (bundled_templates.py).
        self.marked: JinjaChatTemplate | None = None
        self._describe()

    def _describe(self) -> None:
        how = "{% generation %} blocks" if self.marks_generation else "rendering each turn's prefix"
        if self.marked is not None:
            how = f"the {{% generation %}} blocks of the bundled {self.marked.origin}, which writes the same"
        self.description = f"chat template {self.origin} (assistant tokens found by {how})"

    def use_marked(self, marked: JinjaChatTemplate) -> None:
        self.marked = marked
        self._describe()

    def render(self, messages: Sequence[Message], where: str, add_generation_prompt: bool = False,
               spans: list[tuple[int, int]] | None = None, tools: Tools = None) -> str:
        """The template's text for `messages`; with `spans`, the {% generation %} blocks' spans are appended to it."""
        context = {
            **self.variables, "messages": list(messages), "tools": tools, "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            if spans is None:
                return self.template.render(**context)
            blocks: list[str] = []
            with self.env.track(blocks, spans):
                for block in self.template.generate(**context):
                    blocks.append(block)
            return "".join(blocks)
        except Exception as exc:  # jinja2's errors, and whatever a template's own expressions raise (TypeError, ...)
            raise DataError(f"chat template {self.origin} does not render {where}: {first_line(exc)}") from None

    def _assistant_spans(
        self, messages: Sequence[Message], text: str, where: str, tools: Tools
    ) -> list[tuple[int, int]]:
        """The character spans of the assistant turns in `text`, the rendering of `messages` (see the module doc)."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = self.render(messages[:index], where, add_generation_prompt=True, tools=tools)
            if not text.startswith(prefix):
                raise DataError(
                    f"chat template {self.origin} renders the start of {where} differently from the whole "
                    "conversation, so its assistant turns cannot be found; use a template with {% generation %} "
                    "blocks or set training.chat.train_on_input = true"
                )
            if message.get("tool_calls"):
                end = self._tool_calls_end(messages, index, text, len(prefix), where, tools)
            else:
                end = self._content_end(messages, index, text, len(prefix), where, tools)
            spans.append((len(prefix), self._past_end_of_turn(text, end)))
        return spans

    def _content_end(
        self, messages: Sequence[Message], index: int, text: str, start: int, where: str, tools: Tools
    ) -> int:
        """Where the content of messages[index], an assistant turn starting at `start` of `text`, ends."""
        marked = list(messages)
        marked[index] = {**messages[index], "content": messages[index]["content"] + CONTENT_MARK}
        other = self.render(marked, where, tools=tools)
        end = next((i for i, (a, b) in enumerate(zip(text, other)) if a != b), len(text))
        if CONTENT_MARK not in other[end:] or not other.endswith(text[end:]) or end < start:
            raise DataError(
                f"chat template {self.origin} does not write the assistant content of {where} as given, so its "
                "assistant tokens cannot be found; use a template with {% generation %} blocks or set "
                "training.chat.train_on_input = true"
            )
        return end

    def _past_end_of_turn(self, text: str, end: int) -> int:
        # The end-of-turn token right after the answer is the model's to predict.
        return end + next((len(t) for t in self.special_tokens if text.startswith(t, end)), 0)

    def _tool_calls_end(
        self, messages: Sequence[Message], index: int, text: str, start: int, where: str, tools: Tools
    ) -> int:
        """Where the tool calls of messages[index], an assistant turn starting at `start` of `text`, end. Templates
        write them after the content (Qwen) or instead of it (Llama 3.1), before the end-of-turn token: they are
        the model's output as much as an answer. So the content is found without the calls, and the calls must be
        what changes from the turn's start to the content's end (anything else would leave them untrained, or
        train text that is not the assistant's)."""
        without, plain = self._render_without_calls(messages, index, text, where, tools)
        # `plain` is another text than `text`: where its content ends is checked against the turn's start below.
        content_end = self._content_end(without, index, plain, 0, where, tools)
        # Both renderings start alike up to the turn's start (the prefix); the rest of `plain` after the content
        # must end `text` too, so that all that the calls change lies in between.
        rest = plain[content_end:]
        if not text.endswith(rest) or len(text) - len(rest) < start:
            raise DataError(
                f"chat template {self.origin} writes the tool_calls of {where} outside the assistant's turn, so "
                "they cannot be found; use a template with {% generation %} blocks or set "
                "training.chat.train_on_input = true"
            )
        return len(text) - len(rest)

    def _check_calls_marked(
        self, messages: Sequence[Message], text: str, spans: list[tuple[int, int]], where: str, tools: Tools
    ) -> None:
        """A {% generation %} template marks what trains; tool calls it writes outside its blocks would train
        nothing, without a word, so they are refused."""
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or not message.get("tool_calls"):
                continue
            plain = self._render_without_calls(messages, index, text, where, tools)[1]
            # Inside a block: `text` outside it, before and after, is also the start and the end of `plain`.
            inside = (
                text[:start] == plain[:start] and plain.endswith(text[end:]) and len(text) - end <= len(plain) - start
                for start, end in spans
            )
            if not any(inside):
                raise DataError(
                    f"chat template {self.origin} writes the tool_calls of {where} outside its {{% generation %}} "
                    "blocks, so they would not be trained; put them inside, or set training.chat.train_on_input = true"
                )

    def _render_without_calls(
        self, messages: Sequence[Message], index: int, text: str, where: str, tools: Tools
    ) -> tuple[list[Message], str]:
        """`messages` without the tool_calls of messages[index] (a null content, which OpenAI's format gives a
        turn of calls only, made empty: a turn without calls has text), and their rendering, which must differ
        from `text` (the rendering with them): a template that ignores the calls would drop them from the data."""
        without = list(messages)
        turn = {k: v for k, v in messages[index].items() if k != "tool_calls"}
        without[index] = {**turn, "content": turn["content"] or ""}
        plain = self.render(without, where, tools=tools)
        if plain == text:
            raise DataError(
                f"chat template {self.origin} does not write the tool_calls of {where}, so they would not be "
                "trained; use a template that writes them, or remove them from the data"
            )
        return without, plain

    def tokenize(
        self, messages: Sequence[Message], where: str, find_targets: bool = True, tools: Tools = None
    ) -> tuple[np.ndarray, np.ndarray]:
        for message in messages:
            if CONTENT_MARK in (message["content"] or ""):
                raise DataError(f"{where} holds the private-use character U+E000, which marks contents; remove it")
        messages = [_with_reasoning_aliases(message) for message in messages]
        if not find_targets:
            text = self.render(messages, where, tools=tools)
            spans = [(0, len(text))]
        elif self.marks_generation:
            spans = []
            text = self.render(messages, where, spans=spans, tools=tools)
            self._check_calls_marked(messages, text, spans, where, tools)
        else:
            text = self.render(messages, where, tools=tools)
            spans = self._marked_spans(messages, text, where, tools)
            if spans is None:
                spans = self._assistant_spans(messages, text, where, tools)
        # The whole text at once, as transformers tokenizes it; a token is a target when its characters overlap an
        # assistant span (transformers' char_to_token rule for its assistant mask).
        encoding = self._encode(text)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        targets = np.zeros(len(offsets), dtype=bool)
        for start, end in spans:
            targets |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return np.asarray(encoding.ids, dtype=np.int64), targets

    def _marked_spans(
        self, messages: Sequence[Message], text: str, where: str, tools: Tools
    ) -> list[tuple[int, int]] | None:
        """The assistant spans the bundled template marks, when it writes `text` for this row too (it wrote what
        this template writes for the probes; a row may still reach a branch where they differ: None then)."""
        if self.marked is None:
            return None
        spans: list[tuple[int, int]] = []
        try:
            marked_text = self.marked.render(messages, where, spans=spans, tools=tools)
        except DataError:
            return None
        return spans if marked_text == text else None

    def _encode(self, text: str) -> Any:
        return self._rust_tokenizer.encode_batch([text], add_special_tokens=False)[0]

    def generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        messages = [_with_reasoning_aliases(message) for message in messages]
        return self._encode(self.render(messages, "the conversation", add_generation_prompt=True)).ids


def _with_reasoning_aliases(message: Message) -> Message:
    """A message's reasoning under both names templates read (`reasoning_content`, and `thinking` for gpt-oss), from
    any of its usual names, as transformers' `_alias_reasoning_fields` does."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}
