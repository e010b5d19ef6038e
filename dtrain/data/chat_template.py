"""Chat templates: a conversation becomes token ids, and a flag per id saying whether it is a trained target.

`JinjaChatTemplate` renders the model's own template (tokenizer_config.json's `chat_template`, or the
chat_template.jinja beside it, which transformers prefers) with jinja2 set up as transformers sets it up
(`transformers.utils.chat_template_utils`): a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the tokenizer's
special tokens (bos_token, eos_token, ...) as variables. The text is tokenized without adding special tokens, so
the ids are those of transformers' `apply_chat_template(messages, tokenize=True)`.

Which characters are the assistant's:
- a template with `{% generation %}` blocks marks them itself (transformers' `return_assistant_tokens_mask`);
- otherwise each assistant turn i is found by rendering: its start is the end of messages[:i] rendered with the
  generation prompt (which must be a prefix of the whole conversation), its end is where the whole conversation
  and the one whose turn-i content carries one more character first differ, extended over a special token that
  follows at once (the end-of-turn token, <|eot_id|> or <|im_end|>: the model must learn to stop).
  Rendering instead of searching for the content survives templates that strip, reformat or wrap the content
  (Qwen3 adds an empty <think> block to the last turn only). A turn that makes tool calls (`tool_calls`) is found
  without its calls, and then takes in what the calls change inside it: the calls the template writes after the
  content (Qwen) or instead of it (Llama 3.1) train with the turn's end-of-turn token, as the assistant's output
  they are; a template that does not write them, or writes them outside the turn, is refused. Its limits: a
  template whose rendering of a prefix differs from the start of the whole conversation is refused (one line: add
  `{% generation %}` or train on all tokens); other text a template writes between the content and its
  end-of-turn token is not trained.
The whole text is tokenized once (the ids are transformers'), and a token is a target when its characters overlap
an assistant span, the rule of transformers' assistant mask; tests/data/test_chat_template.py checks ids and
masks against transformers for Llama 3, Qwen2.5 and Qwen3 templates, tool calls included.

`PlainChatTemplate` is for tokenizers without a template (the byte tokenizer): BOS, then "User: ...\n" lines and
"Assistant: " followed by the answer and EOS; the answer and its EOS are the targets. It has no way to write tool
calls, so a turn with `tool_calls` is refused rather than trained without them.
"""

from __future__ import annotations

import json
import logging
import os
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
        self, messages: Sequence[Message], where: str, find_targets: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids of the conversation and which of them are the assistant's (the trained targets); every one
        without `find_targets` (training on all tokens, where a template's turns need not be found)."""


class PlainChatTemplate(ChatTemplate):
    """BOS, "System: ...\\n" / "User: ...\\n" / "Tool: ...\\n" lines, and "Assistant: " + answer + EOS."""

    description = 'plain template (BOS, "User: ..." lines, "Assistant: " + answer + EOS)'

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def tokenize(
        self, messages: Sequence[Message], where: str, find_targets: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
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
        how = "{% generation %} blocks" if self.marks_generation else "rendering each turn's prefix"
        self.description = f"chat template {origin} (assistant tokens found by {how})"

    def render(self, messages: Sequence[Message], where: str, add_generation_prompt: bool = False,
               spans: list[tuple[int, int]] | None = None) -> str:
        """The template's text for `messages`; with `spans`, the {% generation %} blocks' spans are appended to it."""
        context = {
            **self.variables, "messages": list(messages), "tools": None, "documents": None,
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

    def _assistant_spans(self, messages: Sequence[Message], text: str, where: str) -> list[tuple[int, int]]:
        """The character spans of the assistant turns in `text`, the rendering of `messages` (see the module doc)."""
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = self.render(messages[:index], where, add_generation_prompt=True)
            if not text.startswith(prefix):
                raise DataError(
                    f"chat template {self.origin} renders the start of {where} differently from the whole "
                    "conversation, so its assistant turns cannot be found; use a template with {% generation %} "
                    "blocks or set training.chat.train_on_input = true"
                )
            if message.get("tool_calls"):
                end = self._tool_calls_end(messages, index, text, len(prefix), where)
            else:
                end = self._content_end(messages, index, text, len(prefix), where)
            spans.append((len(prefix), self._past_end_of_turn(text, end)))
        return spans

    def _content_end(self, messages: Sequence[Message], index: int, text: str, start: int, where: str) -> int:
        """Where the content of messages[index], an assistant turn starting at `start` of `text`, ends."""
        marked = list(messages)
        marked[index] = {**messages[index], "content": messages[index]["content"] + CONTENT_MARK}
        other = self.render(marked, where)
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

    def _tool_calls_end(self, messages: Sequence[Message], index: int, text: str, start: int, where: str) -> int:
        """Where the tool calls of messages[index], an assistant turn starting at `start` of `text`, end. Templates
        write them after the content (Qwen) or instead of it (Llama 3.1), before the end-of-turn token: they are
        the model's output as much as an answer. So the content is found without the calls, and the calls must be
        what changes from the turn's start to the content's end (anything else would leave them untrained, or
        train text that is not the assistant's)."""
        without, plain = self._render_without_calls(messages, index, text, where)
        content_end = self._content_end(without, index, plain, start, where)
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
        self, messages: Sequence[Message], text: str, spans: list[tuple[int, int]], where: str
    ) -> None:
        """A {% generation %} template marks what trains; tool calls it writes outside its blocks would train
        nothing, without a word, so they are refused."""
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or not message.get("tool_calls"):
                continue
            plain = self._render_without_calls(messages, index, text, where)[1]
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
        self, messages: Sequence[Message], index: int, text: str, where: str
    ) -> tuple[list[Message], str]:
        """`messages` without the tool_calls of messages[index], and their rendering, which must differ from `text`
        (the rendering with them): a template that ignores the calls would drop them from the data."""
        without = list(messages)
        without[index] = {k: v for k, v in messages[index].items() if k != "tool_calls"}
        plain = self.render(without, where)
        if plain == text:
            raise DataError(
                f"chat template {self.origin} does not write the tool_calls of {where}, so they would not be "
                "trained; use a template that writes them, or remove them from the data"
            )
        return without, plain

    def tokenize(
        self, messages: Sequence[Message], where: str, find_targets: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        for message in messages:
            if CONTENT_MARK in message["content"]:
                raise DataError(f"{where} holds the private-use character U+E000, which marks contents; remove it")
        messages = [_with_reasoning_aliases(message) for message in messages]
        if not find_targets:
            text = self.render(messages, where)
            spans = [(0, len(text))]
        elif self.marks_generation:
            spans = []
            text = self.render(messages, where, spans=spans)
            self._check_calls_marked(messages, text, spans, where)
        else:
            text = self.render(messages, where)
            spans = self._assistant_spans(messages, text, where)
        # The whole text at once, as transformers tokenizes it; a token is a target when its characters overlap an
        # assistant span (transformers' char_to_token rule for its assistant mask).
        encoding = self._rust_tokenizer.encode_batch([text], add_special_tokens=False)[0]
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        targets = np.zeros(len(offsets), dtype=bool)
        for start, end in spans:
            targets |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return np.asarray(encoding.ids, dtype=np.int64), targets


def _with_reasoning_aliases(message: Message) -> Message:
    """A message's reasoning under both names templates read (`reasoning_content`, and `thinking` for gpt-oss), from
    any of its usual names, as transformers' `_alias_reasoning_fields` does."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _template_source(folder: str, config: dict[str, Any], config_file: str) -> tuple[str, str] | None:
    """(template text, where it came from) of a tokenizer folder, or None when it has none. chat_template.jinja
    wins over tokenizer_config.json's chat_template, as in transformers; a list of named templates gives its
    "default"."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
        if template is None:
            raise DataError(f"{config_file} lists chat templates {', '.join(map(str, named))} but no 'default' one")
    if template is None:
        return None
    if not isinstance(template, str):
        raise DataError(f"{config_file} chat_template must be a string, got {type(template).__name__}")
    return template, f"{config_file} chat_template"


def build_chat_template(tokenizer: Tokenizer, chat_template: str = "") -> ChatTemplate:
    """The template `training.chat.chat_template` asks for: "" the tokenizer's own (plain when it has none),
    "plain", or a .jinja file (which needs a Hugging Face tokenizer). Says which in one log line."""
    from dtrain.data.hf_tokenizer import SPECIAL_TOKEN_KEYS, read_tokenizer_config, token_content

    if chat_template == PLAIN:
        logger.info("chat data: the plain template (training.chat.chat_template = plain)")
        return PlainChatTemplate(tokenizer)
    if tokenizer.kind != "hf":
        if chat_template:
            raise DataError(
                f"training.chat.chat_template {chat_template!r} needs a Hugging Face tokenizer (tokenizer.json) that "
                f"maps its special tokens' text to ids; model.tokenizer is {tokenizer.kind}: use chat_template = plain"
            )
        logger.info("chat data: the plain template (the %s tokenizer has no chat template)", tokenizer.kind)
        return PlainChatTemplate(tokenizer)
    config_file, config = read_tokenizer_config(tokenizer.path)
    if chat_template:
        if not os.path.isfile(chat_template):
            raise DataError(f"training.chat.chat_template {chat_template!r} is not a file; give a .jinja file, "
                            "plain, or leave it empty for the tokenizer's own")
        with open(chat_template, encoding="utf-8") as f:
            found: tuple[str, str] | None = (f.read(), chat_template)
    else:
        found = _template_source(os.path.dirname(tokenizer.path), config, config_file)
    if found is None:
        logger.info("chat data: the plain template (%s has no chat_template)", config_file)
        return PlainChatTemplate(tokenizer)
    variables = {}
    for key in SPECIAL_TOKEN_KEYS:
        content = token_content(config.get(key), f"{config_file} {key}")
        if content is not None:
            variables[key] = content
    decoder = config.get("added_tokens_decoder") or {}
    special = [entry.get("content") for entry in decoder.values() if isinstance(entry, dict) and entry.get("special")]
    template = JinjaChatTemplate(found[0], found[1], tokenizer, variables, [*special, *variables.values()])
    logger.info("chat data: %s", template.description)
    return template
