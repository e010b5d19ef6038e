"""Packing: documents become `[BOS] tokens [EOS]`, concatenated, and cut into non-overlapping windows.

The packer defines one global stream of windows, the same on every rank. Its position is three integers: the
epoch, the source position of the first document not yet fully emitted, and how many of that document's tokens
were already emitted. Resuming seeks the source to that document and re-tokenizes only it, never the documents
before it; the integers also keep the state free of variable-size tensors, which DCP cannot load in place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
import torch

from dtrain.data.sources import Document, DocumentSource
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError

PACKER_STATE_KEYS = ("epoch", "document_position", "token_offset")
# (epoch, start) -> (epoch, position, [BOS] tokens [EOS]) for every document from there on, forever.
TokenizedStream = Callable[[int, int], Iterator[tuple[int, int, np.ndarray]]]


def document_passes(source: DocumentSource, epoch: int, start: int) -> Iterator[tuple[int, int, Document]]:
    """(epoch, position, document) for every document from (epoch, start) on, pass after pass, forever."""
    while True:
        found = False
        for position, document in source.documents(start):
            found = True
            yield epoch, position, document
        if start == 0 and not found:
            raise DataError(f"{source.description} holds no documents; check training.dataset_path")
        epoch, start = epoch + 1, 0


def document_tokens(document: Document, tokenizer: Tokenizer, description: str) -> np.ndarray:
    """`[BOS] tokens [EOS]` of one document, as int64 (numpy, so that worker processes never run torch ops)."""
    if isinstance(document, str):
        document = tokenizer.encode(document)
    if not isinstance(document, (list, tuple, np.ndarray)):
        raise DataError(f"{description} gave a {type(document).__name__} document; expected text")
    # Through numpy: about twice as fast as torch.tensor on a long list of Python ints.
    ids = np.asarray(document, dtype=np.int64)
    return np.concatenate([np.array([tokenizer.bos_id], dtype=np.int64), ids, [tokenizer.eos_id]])


def tokenized_passes(
    source: DocumentSource, tokenizer: Tokenizer, epoch: int, start: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """(epoch, position, [BOS] tokens [EOS]) for every document from (epoch, start) on, forever."""
    for epoch, position, document in document_passes(source, epoch, start):
        yield epoch, position, document_tokens(document, tokenizer, source.description)


class SequencePacker:
    """Endless windows of `window_len` tokens over `source`, epoch after epoch in the same document order.

    `tokenized` tokenizes the documents elsewhere (in worker processes, see workers.py): it must give exactly what
    `tokenized_passes` gives, in the same order. None tokenizes here, with `tokenized_passes`.
    """

    def __init__(
        self, source: DocumentSource, tokenizer: Tokenizer, window_len: int, tokenized: TokenizedStream | None = None
    ):
        self.source, self.tokenizer, self.window_len = source, tokenizer, window_len
        self._tokenize_from = tokenized or (lambda epoch, start: tokenized_passes(source, tokenizer, epoch, start))
        # Tokenized documents not yet fully emitted, as (epoch, position, tokens); the first is emitted up to
        # _head_offset. Whole documents are kept so a window never copies more than it emits.
        self._chunks: deque[tuple[int, int, torch.Tensor]] = deque()
        self._head_offset = 0
        self._buffered = 0
        # Where reading continues once _chunks is empty: the epoch and the next source position, and the tokens
        # of the first document read there that a resumed run already emitted.
        self._epoch, self._next_position, self._pending_skip = 0, 0, 0
        self._tokenized: Iterator[tuple[int, int, np.ndarray]] | None = None
        # What the document stream raised: raised again by every later call (the stream is over) until a load.
        self._failure: Exception | None = None

    def next_windows(self, count: int) -> torch.Tensor:
        """The next `count` windows of the stream, as a LongTensor[count, window_len]."""
        needed = count * self.window_len
        if self._failure is not None:
            raise self._failure
        if self._tokenized is None:
            self._tokenized = self._checked_text(self._epoch, self._next_position)
        while self._buffered < needed:
            try:
                epoch, position, tokens = next(self._tokenized)
            except Exception as exc:
                self._failure = exc
                raise
            self._append(epoch, position, torch.from_numpy(tokens))
        pieces, remaining = [], needed
        while remaining:
            epoch, position, tokens = self._chunks[0]
            take = min(len(tokens) - self._head_offset, remaining)
            pieces.append(tokens[self._head_offset : self._head_offset + take])
            self._head_offset += take
            remaining -= take
            if self._head_offset == len(tokens):
                self._chunks.popleft()
                self._head_offset = 0
                self._epoch, self._next_position = epoch, position + 1
        self._buffered -= needed
        return torch.cat(pieces).view(count, self.window_len)

    def _append(self, epoch: int, position: int, tokens: torch.Tensor) -> None:
        skip, self._pending_skip = self._pending_skip, 0
        if skip:
            # The checkpoint had emitted `skip` tokens of the document at _next_position: it must still be there.
            if position != self._next_position or skip >= len(tokens):
                raise DataError(
                    f"{self.source.description} changed since the checkpoint: document {self._next_position} "
                    "is gone or shorter; resume with the same dataset and tokenizer, or skip the data loader's state "
                    "with checkpoint.exclude_from_loading"
                )
            self._head_offset = skip
        self._chunks.append((epoch, position, tokens))
        self._buffered += len(tokens) - skip

    def _checked_text(self, epoch: int, start: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """The tokenized stream from (epoch, start); DataError once a whole pass held no text."""
        whole_pass, has_text = start == 0, False
        for item in self._tokenize_from(epoch, start):
            if item[0] != epoch:
                if whole_pass and not has_text:
                    # Else it would train on BOS/EOS pairs alone, epoch after epoch, and look healthy.
                    raise DataError(f"{self.source.description} holds no text (every document is empty)")
                epoch, whole_pass, has_text = item[0], True, False
            has_text = has_text or len(item[2]) > 2
            yield item

    def _tokens(self, document: Document) -> torch.Tensor:
        return torch.from_numpy(document_tokens(document, self.tokenizer, self.source.description))

    def state_dict(self) -> dict[str, int]:
        """The stream position: epoch, source position of the next unfinished document, tokens of it emitted."""
        if self._chunks:
            epoch, position, _ = self._chunks[0]
            return {"epoch": epoch, "document_position": position, "token_offset": self._head_offset}
        return {"epoch": self._epoch, "document_position": self._next_position, "token_offset": self._pending_skip}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`: the next window is the one that followed when the state was taken."""
        self._chunks.clear()
        self._head_offset = self._buffered = 0
        self._epoch = int(state["epoch"])
        self._next_position = int(state["document_position"])
        self._pending_skip = int(state["token_offset"])
        self._tokenized, self._failure = None, None


def windows_per_pass(source: DocumentSource, tokenizer: Tokenizer, window_len: int) -> int:
    """How many whole windows of `window_len` tokens one pass over `source` packs into (reads all of it)."""
    if source.endless:
        raise DataError(f"{source.description} never ends: it has no number of windows per pass")
    packer = SequencePacker(source, tokenizer, window_len)
    return sum(len(packer._tokens(document)) for _, document in source.documents(0)) // window_len
