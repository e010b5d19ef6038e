"""Preference samples: each pair becomes one sample, its chosen and its rejected sequence side by side.

A sample is LongTensor[2, PAIR_ROWS, window_len]: for the chosen (0) and the rejected (1) answer, the tokens of
prompt + answer (padded with `pad_id`) and which of them are the answer's (the trained targets). A pair is one
sample, so the loader never splits it between batches or ranks; `preference_batch` turns the samples of a batch
into one forward of 2B sequences, the B chosen then the B rejected (TRL's concatenated order).

Tokens are made as TRL's DPOTrainer makes them: a conversational pair through the chat template (answer tokens
found as the chat data finds them), a plain-text pair as BOS + prompt + answer + EOS, the answer starting where
the prompt's ids and the whole's differ. Long pairs, dropped pairs and the logged counts: docs/preference-tuning.md,
"Data". The state is (epoch, position of the next row), as for chat data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dtrain.config.schema import Training
from dtrain.data.chat_source import ChatRows
from dtrain.data.chat_template import ChatTemplate, Message
from dtrain.data.chat_template_choice import build_chat_template
from dtrain.data.preference_rows import Pair, build_preference_rows, pair_of
from dtrain.data.samples import SampleSource
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError
from dtrain.step.labels import IGNORE_INDEX

logger = logging.getLogger("dtrain")

TOKENS, TARGETS = range(2)
PAIR_ROWS = 2
ANSWERS = ("chosen", "rejected")
# (epoch, position, sample int64[2, PAIR_ROWS, window_len]) of one pair, ready to hand out.
Tokenized = tuple[int, int, np.ndarray]


def preference_batch(samples: torch.Tensor) -> dict[str, torch.Tensor]:
    """The loader's batch of pairs LongTensor[B, 2, PAIR_ROWS, window_len]: input_ids and labels of 2B sequences,
    the B chosen then the B rejected; labels are the next token where it is an answer token, else IGNORE_INDEX."""
    sequences = samples.transpose(0, 1).flatten(0, 1)  # [2B, PAIR_ROWS, window_len]: chosen rows first
    tokens, targets = sequences[:, TOKENS], sequences[:, TARGETS].bool()
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": torch.where(targets[:, 1:], tokens[:, 1:], IGNORE_INDEX).contiguous(),
    }


def _answer_start(targets: np.ndarray, prompt: list[Message], answer: list[Message], name: str, where: str) -> int:
    """Where the answer's tokens start: targets mark every assistant turn, one run each, the answer's last."""
    runs = np.flatnonzero(targets & ~np.concatenate([[False], targets[:-1]]))
    before = sum(message["role"] == "assistant" for message in prompt)
    turns = sum(message["role"] == "assistant" for message in answer)
    if len(runs) < before + turns:
        raise DataError(f"{where}: the {name} answer is empty after templating (none of its tokens would train)")
    if len(runs) > before + turns:
        raise DataError(f"{where}: the template's assistant turns cannot be told apart from the {name} answer")
    return int(runs[before])


class PreferenceSamples(SampleSource):
    """The pairs of `rows`, one sample each, epoch after epoch."""

    def __init__(
        self, rows: ChatRows, template: ChatTemplate, tokenizer: Tokenizer, training: Training, window_len: int
    ):
        self.rows, self.template, self.tokenizer = rows, template, tokenizer
        self.settings, self.chat, self.window_len = training.preference, training.chat, window_len
        self.description = f"preference pairs of {rows.description}, {template.description}"
        self._epoch, self._position = 0, 0
        self._stream: Iterator[Tokenized] | None = None
        self._counts = {"pairs": 0, "dropped": 0, "truncated": 0, "prompts_cut": 0}
        self._reported = False
        self._check_trains()

    def _tokenized(self, pair: Pair, where: str) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """(ids, answer targets, answer start) of the chosen and of the rejected sequence."""
        if not pair.conversational:
            return self._plain(pair)
        sequences = []
        for name in ANSWERS:
            answer = getattr(pair, name)
            ids, targets = self.template.tokenize(pair.prompt + answer, where)
            start = _answer_start(targets, pair.prompt, answer, name, where)
            targets[:start] = False  # the prompt's own assistant turns are context
            sequences.append((ids, targets, start))
        return sequences

    def _plain(self, pair: Pair) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Text as TRL tokenizes it: BOS + prompt, and BOS + prompt + answer + EOS; the answers start where both
        differ from the prompt's ids (tokens may merge across the boundary)."""
        bos, eos = [self.tokenizer.bos_id], [self.tokenizer.eos_id]
        prompt = np.asarray(bos + self.tokenizer.encode(pair.prompt), dtype=np.int64)
        wholes = [np.asarray(bos + self.tokenizer.encode(pair.prompt + getattr(pair, name)) + eos, dtype=np.int64)
                  for name in ANSWERS]
        start = min(_common_prefix(prompt, whole) for whole in wholes)
        return [(whole, np.arange(len(whole)) >= start, start) for whole in wholes]

    def _fitted(self, sequences: list[tuple[np.ndarray, np.ndarray, int]]) -> tuple[np.ndarray | None, bool, bool]:
        """The pair's sample after the length policy (None when it is dropped), whether a sequence was truncated and
        whether a prompt was cut."""
        limit = self.settings.max_prompt_length
        cut = bool(limit) and any(start > limit for _, _, start in sequences)
        if cut:
            sequences = [(ids[max(start - limit, 0):], targets[max(start - limit, 0):], min(start, limit))
                         for ids, targets, start in sequences]
        overlong = any(len(ids) > self.window_len for ids, _, _ in sequences)
        if overlong and self.settings.overlong_policy == "drop":
            return None, overlong, cut
        if any(start >= self.window_len for _, _, start in sequences):  # the prompt alone fills the window
            return None, overlong, cut
        sample = np.zeros((2, PAIR_ROWS, self.window_len), dtype=np.int64)
        sample[:, TOKENS] = self.tokenizer.eos_id  # padding: never a label
        for index, (ids, targets, _) in enumerate(sequences):
            length = min(len(ids), self.window_len)
            sample[index, TOKENS, :length], sample[index, TARGETS, :length] = ids[:length], targets[:length]
        return sample, overlong, cut

    def _samples(self, start: int) -> Iterator[tuple[int, np.ndarray | None, bool, bool]]:
        for position, where, row in self.rows.rows(start):
            pair = pair_of(row, self.settings, self.chat, where)
            yield position, *self._fitted(self._tokenized(pair, where))

    def _check_trains(self) -> None:
        """Rows are read until one pair fits, so a wrong field, a template that does not render or data of which
        nothing fits stops the run in the pre-flight, before it writes anything."""
        read = False
        for _, sample, _, _ in self._samples(0):
            read = True
            if sample is not None:
                return
        if not read:
            raise DataError(f"{self.rows.description} holds no rows; check training.dataset_path")
        raise DataError(
            f"{self.rows.description}: no pair fits in seq_len + 1 = {self.window_len} tokens with an answer token; "
            "raise training.seq_len, or set training.preference.overlong_policy = truncate"
        )

    def _pairs(self, epoch: int, start: int) -> Iterator[Tokenized]:
        """Every kept pair from (epoch, start) on, forever."""
        while True:
            for position, sample, truncated, cut in self._samples(start):
                self._counts["pairs"] += 1
                self._counts["prompts_cut"] += cut
                self._counts["truncated"] += truncated and sample is not None
                if sample is None:
                    self._counts["dropped"] += 1
                    continue
                yield epoch, position, sample
            self._report(start)
            epoch, start = epoch + 1, 0
            self._counts = dict.fromkeys(self._counts, 0)

    def _report(self, start: int) -> None:
        # One line for the first whole pass this process reads (a pass resumed part-way counts only its rest).
        if self._reported or start:
            return
        self._reported = True
        c, s = self._counts, self.settings
        logger.info(
            "preference data, one pass over %s: %d pairs, %d dropped (training.preference.overlong_policy = %s, or "
            "the prompt alone fills seq_len + 1 = %d tokens), %d truncated to it, %d prompts cut to "
            "max_prompt_length = %d",
            self.rows.description, c["pairs"], c["dropped"], s.overlong_policy, self.window_len, c["truncated"],
            c["prompts_cut"], s.max_prompt_length,
        )

    def _next(self) -> np.ndarray:
        if self._stream is None:
            self._stream = self._pairs(self._epoch, self._position)
        epoch, position, sample = next(self._stream)
        self._epoch, self._position = epoch, position + 1
        return sample

    def take(self, count: int, first: int, keep: int) -> torch.Tensor:
        samples = [self._next() for _ in range(count)][first : first + keep]
        if not samples:
            return torch.empty(0, 2, PAIR_ROWS, self.window_len, dtype=torch.long)
        return torch.from_numpy(np.stack(samples))

    def samples_per_pass(self) -> int:
        return sum(sample is not None for _, sample, _, _ in self._samples(0))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "document_position": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch, self._position = int(state["epoch"]), int(state["document_position"])
        self._stream = None


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    length = min(len(a), len(b))
    differ = np.flatnonzero(a[:length] != b[:length])
    return int(differ[0]) if len(differ) else length


def build_preference_samples(training: Training, tokenizer: Tokenizer) -> PreferenceSamples:
    """The pairs of `training.dataset_path` (the bundled ones when empty) in windows of seq_len + 1 tokens."""
    rows = build_preference_rows(training.dataset_path, training.chat)
    template = build_chat_template(tokenizer, training.chat.chat_template)
    return PreferenceSamples(rows, template, tokenizer, training, training.seq_len + 1)
