"""Packing: documents become `[BOS] tokens [EOS]`, concatenated, and cut into non-overlapping windows.

The packer defines one global stream of windows, the same on every rank. Its position is three integers: the
epoch, the source position of the first document not yet fully emitted, and how many of that document's tokens
were already emitted. Resuming seeks the source to that document and re-tokenizes only it, never the documents
before it; the integers also keep the state free of variable-size tensors, which DCP cannot load in place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np
import torch

from dtrain.data.sources import Document, DocumentSource
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError

PACKER_STATE_KEYS = ("epoch", "document_position", "token_offset")


class SequencePacker:
    """Endless windows of `window_len` tokens over `source`, epoch after epoch in the same document order."""

    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, window_len: int):
        self.source, self.tokenizer, self.window_len = source, tokenizer, window_len
        # Tokenized documents not yet fully emitted, as (epoch, position, tokens); the first is emitted up to
        # _head_offset. Whole documents are kept so a window never copies more than it emits.
        self._chunks: deque[tuple[int, int, torch.Tensor]] = deque()
        self._head_offset = 0
        self._buffered = 0
        # Where reading continues once _chunks is empty: the epoch and the next source position, and the tokens
        # of the first document read there that a resumed run already emitted.
        self._epoch, self._next_position, self._pending_skip = 0, 0, 0
        self._tokenized: Iterator[tuple[int, int, torch.Tensor]] | None = None

    def next_windows(self, count: int) -> torch.Tensor:
        """The next `count` windows of the stream, as a LongTensor[count, window_len]."""
        needed = count * self.window_len
        if self._tokenized is None:
            self._tokenized = self._tokenized_documents(self._epoch, self._next_position)
        while self._buffered < needed:
            self._append(*next(self._tokenized))
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

    def _tokenized_documents(self, epoch: int, start: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(epoch, position, [BOS] tokens [EOS]) for every document from (epoch, start) on, forever."""
        while True:
            found = has_text = False
            for position, document in self.source.documents(start):
                tokens = self._tokens(document)
                found, has_text = True, has_text or len(tokens) > 2
                yield epoch, position, tokens
            if start == 0 and not found:
                raise DataError(f"{self.source.description} holds no documents; check training.dataset_path")
            if start == 0 and not has_text:
                # Else it would train on BOS/EOS pairs alone, epoch after epoch, and look healthy.
                raise DataError(f"{self.source.description} holds no text (every document is empty)")
            epoch, start = epoch + 1, 0

    def _tokens(self, document: Document) -> torch.Tensor:
        if isinstance(document, str):
            document = self.tokenizer.encode(document)
        if isinstance(document, (list, tuple, np.ndarray)):
            # Through numpy: about twice as fast as torch.tensor on a long list of Python ints.
            ids = torch.from_numpy(np.asarray(document, dtype=np.int64))
        else:
            raise DataError(f"{self.source.description} gave a {type(document).__name__} document; expected text")
        bos = torch.tensor([self.tokenizer.bos_id], dtype=torch.long)
        eos = torch.tensor([self.tokenizer.eos_id], dtype=torch.long)
        return torch.cat([bos, ids, eos])

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
        self._tokenized = None
