"""Chat rows: conversations read from local JSON-lines files or a local Hugging Face dataset, in a fixed order.

A row is either OpenAI-style messages (`{"messages": [{"role": "user", "content": ...}, ...]}`, multi-turn, with
system / user / assistant / tool roles; ShareGPT's human / gpt roles are accepted too) or a prompt/completion pair
(`{"prompt": ..., "completion": ...}`, texts or lists of messages as TRL writes them). OpenAI's tool use is
understood as it is written: a row's `tools` (the functions offered, for the template to write), assistant turns
with `tool_calls` (and a null content when they only call), and `tool` turns with the results. The field names are
`training.chat`'s (messages_field, role_field, content_field, prompt_field, completion_field), as torchtune's and
axolotl's column maps do it. Every conversation needs an assistant turn; a bad row stops the run with its file and
line (or dataset row).

Positions, as the packer stores them: file_index * FILE_STRIDE + line of a JSON-lines file, or the row index of a
dataset, so a resume seeks without parsing what came before.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from dtrain.config.schema_chat import Chat
from dtrain.data.chat_template import Message, Tools
from dtrain.data.file_readers import FILE_STRIDE, json_lines
from dtrain.data.missing_path import missing
from dtrain.errors import DataError, first_line

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's role names (torchtune's ShareGPTToMessages maps them the same way).
ROLE_ALIASES = {"human": "user", "gpt": "assistant"}
JSON_LINES = (".jsonl", ".json")
# A row's field holding its tool definitions (the `tools` of TRL's datasets and OpenAI's requests).
TOOLS_FIELD = "tools"
ASSETS = os.path.join(os.path.dirname(__file__), "assets")
# The bundled arithmetic conversations (training.dataset = chat with no dataset_path): a train and a held-out file.
BUNDLED = {"train": os.path.join(ASSETS, "chat_arithmetic.jsonl"),
           "validation": os.path.join(ASSETS, "chat_arithmetic_validation.jsonl")}


class ChatRows:
    """The rows of a chat dataset: `rows(start)` yields (position, where, row) from position `start` on."""

    description: str

    def rows(self, start: int = 0) -> Iterator[tuple[int, str, Any]]:
        raise NotImplementedError


class JsonLinesRows(ChatRows):
    """One .jsonl/.json file (a JSON object per line), or every such file under a folder in sorted path order."""

    def __init__(self, path: str):
        if os.path.isfile(path):
            self.files = [path]
        elif os.path.isdir(path):
            found = [
                os.path.join(folder, name)
                for folder, _, names in os.walk(path) for name in names if name.endswith(JSON_LINES)
            ]
            self.files = sorted(found, key=lambda p: os.path.relpath(p, path).replace(os.sep, "/"))
            if not self.files:
                raise DataError(f"training.dataset_path folder {path!r} holds no .jsonl or .json files")
        else:
            raise DataError(f"training.dataset_path {missing(path)}; give a .jsonl file or a folder of them")
        many = len(self.files) > 1
        self.description = f"{len(self.files)} chat files in {path!r}" if many else f"chat file {path!r}"

    def rows(self, start: int = 0) -> Iterator[tuple[int, str, Any]]:
        for index in range(start // FILE_STRIDE, len(self.files)):
            first = start - index * FILE_STRIDE if index == start // FILE_STRIDE else 0
            path = self.files[index]
            for line_index, where, row in json_lines(path, first, label=str(path)):
                yield index * FILE_STRIDE + line_index, where, row


class HFChatRows(ChatRows):
    """A local Hugging Face dataset's train split: a save_to_disk folder (memory-mapped, seeks by row), or data
    files read with `load_dataset` (streamed from disk with `streaming`)."""

    def __init__(self, path: str, streaming: bool):
        from dtrain.data.hf_source import FILE_BUILDERS, _import_datasets, _is_saved_dataset

        datasets = _import_datasets("chat")
        self.path, self.description = path, f"Hugging Face chat dataset {path!r}"
        try:
            if _is_saved_dataset(path):
                loaded = datasets.load_from_disk(path)
                self.dataset = loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
            else:
                builder = next((b for s, b in FILE_BUILDERS.items() if path.endswith(s)), None)
                args, kwargs = ((builder,), {"data_files": path}) if os.path.isfile(path) else ((path,), {})
                self.dataset = datasets.load_dataset(*args, split="train", streaming=streaming, **kwargs)
        except Exception as exc:  # datasets raises many types for a missing split, unreadable files, ...
            raise DataError(f"cannot load Hugging Face dataset {path!r} ({first_line(exc)})") from None

    def rows(self, start: int = 0) -> Iterator[tuple[int, str, Any]]:
        length = getattr(self.dataset, "num_rows", None)
        if length is not None and start >= length:  # Dataset.skip rejects a start past the end
            return
        for position, row in enumerate(self.dataset.skip(start), start=start):
            yield position, f"row {position} of Hugging Face dataset {self.path!r}", row


def build_chat_rows(path: str, chat: Chat, split: str = "train") -> ChatRows:
    """The rows at `path`: the bundled arithmetic file of `split` when empty; .jsonl/.json files (or a folder of
    them) are read here; a save_to_disk folder, other data files (Parquet, CSV, ...) or `chat.streaming` go through
    `datasets`."""
    if not path:
        return JsonLinesRows(BUNDLED[split])
    if not os.path.exists(path):
        raise DataError(f"training.dataset_path {missing(path)}; datasets are read from local paths only")
    from dtrain.data.hf_source import _is_saved_dataset

    json_lines = os.path.isdir(path) and not _is_saved_dataset(path) or path.endswith(JSON_LINES)
    if json_lines and not chat.streaming:
        return JsonLinesRows(path)
    return HFChatRows(path, chat.streaming)


def _message(value: Any, chat: Chat, where: str) -> Message:
    if not isinstance(value, dict):
        raise DataError(f"{where}: a message must be an object with {chat.role_field!r} and {chat.content_field!r}")
    missing = [name for name in (chat.role_field, chat.content_field) if name not in value]
    if missing:
        raise DataError(
            f"{where}: a message has no field {missing[0]!r} (fields: {', '.join(sorted(value))}); set "
            f"training.chat.{'role_field' if missing[0] == chat.role_field else 'content_field'}"
        )
    role = ROLE_ALIASES.get(value[chat.role_field], value[chat.role_field])
    if role not in ROLES:
        raise DataError(f"{where}: role {value[chat.role_field]!r} is not one of {', '.join(ROLES)}, human, gpt")
    content = value[chat.content_field]
    # OpenAI's format: an assistant turn that only calls tools has a null content (passed on as it is, as
    # transformers does: templates test it).
    calls_only = content is None and role == "assistant" and value.get("tool_calls")
    if not isinstance(content, str) and not calls_only:
        raise DataError(
            f"{where}: a {role} message's {chat.content_field!r} is {type(content).__name__}, not text (null only "
            "in an assistant turn with tool_calls)"
        )
    # Other keys (reasoning_content, tool_calls, ...) reach the template as they are, as in transformers.
    others = {k: v for k, v in value.items() if k not in (chat.role_field, chat.content_field) and v is not None}
    return {**others, "role": role, "content": content}


def _messages(value: Any, chat: Chat, where: str, field: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": "user" if field == chat.prompt_field else "assistant", "content": value}]
    if not isinstance(value, list):
        raise DataError(f"{where}: field {field!r} is {type(value).__name__}; expected a list of messages or text")
    return [_message(item, chat, where) for item in value]


def row_tools(row: dict[str, Any], where: str) -> Tools:
    """The row's `tools` (the functions offered to the model, for the template to write), as TRL and OpenAI rows
    carry them: a list of JSON schemas, or that list as JSON text (Parquet and CSV files hold it so)."""
    tools = row.get(TOOLS_FIELD)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as exc:
            raise DataError(f"{where}: field {TOOLS_FIELD!r} is text but not JSON ({first_line(exc)})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(
            f"{where}: field {TOOLS_FIELD!r} must be a list of tool schemas ({{\"type\": \"function\", "
            f"\"function\": {{...}}}}), got {type(tools).__name__}"
        )
    return tools or None


def conversation(row: Any, chat: Chat, where: str) -> list[Message]:
    """The messages of one row, in the template's form ({"role", "content", ...}); DataError names `where`."""
    if not isinstance(row, dict):
        raise DataError(f"{where} is not an object; each row holds {chat.messages_field!r} or a prompt/completion")
    if chat.messages_field in row:
        messages = _messages(row[chat.messages_field], chat, where, chat.messages_field)
    elif chat.prompt_field in row and chat.completion_field in row:
        messages = _messages(row[chat.prompt_field], chat, where, chat.prompt_field)
        messages += _messages(row[chat.completion_field], chat, where, chat.completion_field)
    else:
        raise DataError(
            f"{where} has neither {chat.messages_field!r} nor {chat.prompt_field!r} + {chat.completion_field!r} "
            f"(fields: {', '.join(sorted(row)) or 'none'}); set training.chat.messages_field, or prompt_field and "
            "completion_field"
        )
    if not any(message["role"] == "assistant" for message in messages):
        raise DataError(f"{where} has no assistant turn: there is nothing to train on; every row needs an answer")
    return messages
