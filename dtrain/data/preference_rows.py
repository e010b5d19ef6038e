"""Preference rows: a prompt and two answers, the chosen and the rejected one, in the formats TRL's DPOTrainer reads.

- explicit prompt, conversational: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`;
- implicit prompt: `{"chosen": [messages], "rejected": [messages]}`, the prompt being the messages both
  conversations start with (TRL's `extract_prompt`);
- plain text: `{"prompt": "...", "chosen": "...", "rejected": "..."}`, tokenized as text, not templated (as TRL
  does for a row that is not conversational); a text answer to a conversational prompt is an assistant message.
The field names are `training.preference`'s; the messages' are `training.chat`'s. Rows are read by the chat data's
readers (JSON lines, local Hugging Face datasets), so positions and resumes work as for chat data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dtrain.config.preference import Preference
from dtrain.config.schema_chat import Chat
from dtrain.data.chat_source import ASSETS, ChatRows, JsonLinesRows, _messages, build_chat_rows
from dtrain.data.chat_template import Message
from dtrain.errors import DataError

# The bundled pairs (training.dataset = preference with no dataset_path): arithmetic answers, right and wrong.
BUNDLED = os.path.join(ASSETS, "preference_arithmetic.jsonl")


@dataclass(frozen=True)
class Pair:
    """One row: conversational (`prompt` and the answers are messages) or plain text (all three are strings)."""

    prompt: list[Message] | str
    chosen: list[Message] | str
    rejected: list[Message] | str

    @property
    def conversational(self) -> bool:
        return not isinstance(self.prompt, str)


def build_preference_rows(path: str, chat: Chat) -> ChatRows:
    """The rows at `path` (the bundled pairs when empty), read as chat rows are."""
    return JsonLinesRows(BUNDLED) if not path else build_chat_rows(path, chat)


def _shared_start(chosen: list[Message], rejected: list[Message]) -> int:
    count = 0
    while count < min(len(chosen), len(rejected)) and chosen[count] == rejected[count]:
        count += 1
    return count


def pair_of(row: Any, settings: Preference, chat: Chat, where: str) -> Pair:
    """The pair of one row; DataError naming `where` for a row that is not one."""
    if not isinstance(row, dict):
        raise DataError(f"{where} is not an object; each row holds {settings.chosen_field!r} and "
                        f"{settings.rejected_field!r}")
    for key, field_name in (("chosen_field", settings.chosen_field), ("rejected_field", settings.rejected_field)):
        if field_name not in row:
            raise DataError(
                f"{where} has no field {field_name!r} (fields: {', '.join(sorted(row)) or 'none'}); each row needs "
                f"a chosen and a rejected answer: set training.preference.{key}"
            )
    chosen, rejected = row[settings.chosen_field], row[settings.rejected_field]
    prompt = row.get(settings.prompt_field)
    if chosen == rejected:
        raise DataError(f"{where}: the chosen and the rejected answer are the same; a pair must differ")
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        return Pair(prompt, chosen, rejected)
    chosen = _messages(chosen, chat, where, settings.chosen_field)
    rejected = _messages(rejected, chat, where, settings.rejected_field)
    if prompt is None:  # implicit: the prompt is what both conversations start with
        shared = _shared_start(chosen, rejected)
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        # A text prompt is the user's turn (chat_source's rule for prompt/completion rows).
        prompt = _messages(prompt, chat, where, chat.prompt_field)
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer or answer[-1]["role"] != "assistant":
            raise DataError(f"{where}: the {name} answer does not end with an assistant turn; nothing to compare")
    return Pair(prompt, chosen, rejected)
