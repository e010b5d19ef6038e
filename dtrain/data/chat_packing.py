"""Chat samples: whole conversations placed into windows of `seq_len + 1` tokens, with their targets and documents.

Each window is three rows of `window_len` ids: the tokens, whether each token is a trained target (the assistant's,
or every token with `train_on_input`), and its document (the conversation's index in the window). Packed, the
conversations follow each other until the next one does not fit, which starts the next window (the rest is
padding: EOS ids, no target, a document of its own); a conversation is never split between windows. Unpacked,
each window holds one conversation. `chat_batch` turns windows into the loader's batch: labels are the next token
where that token is a target of the same conversation, else IGNORE_INDEX, so the global-token normalisation
counts exactly the trained tokens. Overlong conversations, the fill line and refusals: docs/fine-tuning.md,
"Chat data". The state is two ints, (epoch, position of the first row not yet placed): a window is a function of
where it starts, so a resume re-reads from that row and continues with the very same windows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dtrain.config.schema import Training
from dtrain.config.schema_chat import Chat
from dtrain.data.chat_source import ChatRows, build_chat_rows, conversation, row_tools
from dtrain.data.chat_template import ChatTemplate
from dtrain.data.chat_template_choice import build_chat_template
from dtrain.data.held_out import HeldOutRows
from dtrain.data.samples import SampleSource
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError
from dtrain.step.labels import IGNORE_INDEX

logger = logging.getLogger("dtrain")

# The rows of a chat window (ChatSamples.take gives LongTensor[keep, CHAT_ROWS, window_len]).
TOKENS, TARGETS, DOCUMENTS = range(3)
CHAT_ROWS = 3
# (epoch, position, ids, targets) of one conversation, ready to place.
Tokenized = tuple[int, int, np.ndarray, np.ndarray]


def chat_batch(windows: torch.Tensor, document_masking: bool) -> dict[str, torch.Tensor]:
    """The loader's batch of chat windows LongTensor[batch, CHAT_ROWS, window_len]: input_ids, labels (the next
    token where it is a target of the same conversation, else IGNORE_INDEX) and, with `document_masking`,
    document_ids."""
    tokens, documents = windows[:, TOKENS], windows[:, DOCUMENTS]
    same_document = documents[:, 1:] == documents[:, :-1]
    trained = windows[:, TARGETS, 1:].bool() & same_document
    batch = {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": torch.where(trained, tokens[:, 1:], IGNORE_INDEX).contiguous(),
    }
    if document_masking:
        batch["document_ids"] = documents[:, :-1].contiguous()
    return batch


class ChatSamples(SampleSource):
    """Windows of `window_len` tokens of the conversations in `rows`, tokenized with `template`, epoch after epoch."""

    def __init__(self, rows: ChatRows, template: ChatTemplate, chat: Chat, window_len: int, pad_id: int):
        self.rows, self.template, self.chat = rows, template, chat
        self.window_len, self.pad_id = window_len, pad_id
        packing = "packed" if chat.packed else "one per sequence, padded"
        trained = "every token" if chat.train_on_input else "assistant tokens"
        self.description = f"{rows.description}, {template.description}, {packing}, training on {trained}"
        self._epoch, self._position = 0, 0
        self._stream: Iterator[Tokenized] | None = None
        self._pending: Tokenized | None = None  # read, but did not fit in the last window
        self._counts = {"conversations": 0, "dropped": 0, "truncated": 0, "tokens": 0, "targets": 0}
        # The windows of the pass being placed: how full they are (placed, trained and padding tokens).
        self._fill = {"windows": 0, "placed": 0, "trained": 0, "padding": 0}
        # (epoch, its counts, or None when it was resumed part-way) of a pass whose rows are all read, until the
        # window in which it ended is complete.
        self._ended: tuple[int, dict[str, int] | None] | None = None
        self._reported: set[int] = set()
        self._check_trains()

    def _tokenized(self, row: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
        messages = conversation(row, self.chat, where)
        tools = row_tools(row, where)
        return self.template.tokenize(messages, where, find_targets=not self.chat.train_on_input, tools=tools)

    def _fitted(self, ids: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """A conversation after the overlong policy: as it is, cut to a window, or None when dropped."""
        if len(ids) <= self.window_len:
            return ids, targets
        if self.chat.overlong_policy == "drop":
            return None
        return ids[: self.window_len], targets[: self.window_len]

    def _check_trains(self) -> None:
        """Rows are read until a conversation trains within a window, so that a wrong field name, a template that
        does not render, or data of which nothing fits stops the run when this source is built, in the pre-flight,
        before it writes anything; only data that is refused costs a whole pass. A later bad row stops the run
        when it is reached, naming its line."""
        read = False
        for _, where, row in self.rows.rows(0):
            read = True
            fitted = self._fitted(*self._tokenized(row, where))
            if fitted is not None and fitted[1][1:].any():  # a conversation's first token is never a label
                return
        if not read:
            raise DataError(f"{self.rows.description} holds no rows; check training.dataset_path")
        raise DataError(
            f"{self.rows.description}: no conversation has a trained token within seq_len + 1 = {self.window_len} "
            "tokens; raise training.seq_len or set training.chat.overlong_policy = truncate"
        )

    def _conversations(self, epoch: int, start: int) -> Iterator[Tokenized]:
        """Every conversation from (epoch, start) on, forever, after the overlong policy."""
        while True:
            for position, where, row in self.rows.rows(start):
                ids, targets = self._tokenized(row, where)
                self._counts["conversations"] += 1
                fitted = self._fitted(ids, targets)
                if fitted is None:
                    self._counts["dropped"] += 1
                    continue
                if len(fitted[0]) < len(ids):
                    self._counts["truncated"] += 1
                ids, targets = fitted
                self._counts["tokens"] += len(ids)
                self._counts["targets"] += int(targets[1:].sum())  # a conversation's first token is never a label
                yield epoch, position, ids, targets
            # A pass resumed part-way counts only its rest: not reported.
            self._ended = (epoch, None if start else dict(self._counts))
            epoch, start = epoch + 1, 0
            self._counts = dict.fromkeys(self._counts, 0)

    def _count_window(self, filled: int, trained: int, first_epoch: int) -> None:
        """Counts a complete window into its pass's fill: the pass of its first conversation. The pass that ended
        while it was placed is reported once it is counted (this window is its last) or before (it is the next
        pass's first)."""
        ended = self._ended
        if ended is not None and first_epoch != ended[0]:
            self._end_pass(*ended)
        self._fill["windows"] += 1
        self._fill["placed"] += filled
        self._fill["trained"] += trained
        self._fill["padding"] += self.window_len - filled
        if ended is not None and first_epoch == ended[0]:
            self._end_pass(*ended)

    def _end_pass(self, epoch: int, counts: dict[str, int] | None) -> None:
        # Every whole pass counts the same: one line, for the first this process reads from its beginning (a small
        # dataset is passed over every few steps).
        fill, self._fill, self._ended = self._fill, dict.fromkeys(self._fill, 0), None
        if self._reported or counts is None:
            return
        self._reported.add(epoch)
        windows = max(fill["windows"], 1)
        logger.info(
            "chat data, pass %d over %s: %d conversations, %d dropped and %d truncated as longer than "
            "seq_len + 1 = %d tokens (training.chat.overlong_policy = %s); %d of their %d tokens are trained; "
            "%d sequences, each on average %.1f conversation tokens (%.0f%% full), %.1f trained, %.1f padding",
            epoch, self.rows.description,
            counts["conversations"], counts["dropped"], counts["truncated"], self.window_len,
            self.chat.overlong_policy, counts["targets"], counts["tokens"], fill["windows"],
            fill["placed"] / windows, 100 * fill["placed"] / (windows * self.window_len),
            fill["trained"] / windows, fill["padding"] / windows,
        )

    def _next(self) -> Tokenized:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            return pending
        if self._stream is None:
            self._stream = self._conversations(self._epoch, self._position)
        return next(self._stream)

    def _window(self) -> np.ndarray:
        window = np.empty((CHAT_ROWS, self.window_len), dtype=np.int64)
        filled, document, trained, first_epoch = 0, 0, 0, None
        while filled < self.window_len:
            item = self._next()
            epoch, position, ids, targets = item
            if filled + len(ids) > self.window_len:  # never for the first: overlong ones were dropped or cut
                self._pending = item
                break
            first_epoch = epoch if first_epoch is None else first_epoch
            trained += int(targets[1:].sum())  # a conversation's first token is never a label
            end = filled + len(ids)
            window[TOKENS, filled:end], window[TARGETS, filled:end], window[DOCUMENTS, filled:end] = (
                ids, targets, document
            )
            filled, document = end, document + 1
            self._epoch, self._position = epoch, position + 1
            if not self.chat.packed:
                break
        if self._pending is not None:
            self._epoch, self._position = self._pending[0], self._pending[1]
        window[TOKENS, filled:], window[TARGETS, filled:], window[DOCUMENTS, filled:] = self.pad_id, 0, document
        self._count_window(filled, trained, first_epoch)
        return window

    def take(self, count: int, first: int, keep: int) -> torch.Tensor:
        windows = [self._window() for _ in range(count)]
        if not windows[first : first + keep]:
            return torch.empty(0, CHAT_ROWS, self.window_len, dtype=torch.long)
        return torch.from_numpy(np.stack(windows[first : first + keep]))

    def samples_per_pass(self) -> int:
        counter = ChatSamples(self.rows, self.template, self.chat, self.window_len, self.pad_id)
        counter._reported = self._reported  # one report line per pass, whichever instance reads it
        windows = 0
        while counter._epoch == 0:
            counter._window()
            windows += 1
        # The last window counted holds the next pass's first conversation unless that one was left pending for
        # the window after it (position 0): then it is not one of this pass's windows.
        return windows - (counter._epoch > 0 and counter._position > 0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "document_position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch, self._position = int(state["epoch"]), int(state["document_position"])
        self._stream, self._pending = None, None
        self._fill, self._ended = dict.fromkeys(self._fill, 0), None


def build_chat_samples(
    training: Training, tokenizer: Tokenizer, split: str = "train", held_out: float = 0.0
) -> ChatSamples:
    """The chat samples of `training.dataset_path` (the bundled file of `split` when empty; with `held_out`, the
    share of its rows that `split` reads: data/held_out.py) in windows of
    training.seq_len + 1 tokens, tokenized with `training.chat`'s template; padding is EOS."""
    rows = build_chat_rows(training.dataset_path, training.chat, split)
    if held_out:  # validation reads this share of the rows, training the others
        rows = HeldOutRows(rows, held_out, held=split == "validation")
    template = build_chat_template(tokenizer, training.chat.chat_template)
    return ChatSamples(rows, template, training.chat, training.seq_len + 1, tokenizer.eos_id)
