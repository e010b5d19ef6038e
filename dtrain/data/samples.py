"""Sample sources: the training windows (`seq_len + 1` tokens) of one dataset in one global order.

`PackedSamples` packs a document source as it goes (every rank packs all windows and keeps its slice);
`TokenSamples` reads a pre-tokenized dataset at random (a rank reads only its own windows, each epoch in a seeded
order). A source's state is a few ints, the same on every rank, so a resume with any number of ranks continues
the global order exactly (docs/data.md).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dtrain.data.background import Stopped
from dtrain.data.packing import PACKER_STATE_KEYS, SequencePacker, tokenized_passes, windows_per_pass
from dtrain.data.shuffle import Permutation
from dtrain.data.sources import DocumentSource
from dtrain.data.token_shards import TokenShards
from dtrain.data.tokenizer import Tokenizer
from dtrain.data.workers import TokenizerPool
from dtrain.errors import DataError


class SampleSource(ABC):
    """Windows of `window_len` tokens in a global order; `take` hands them out in turn."""

    description: str

    @abstractmethod
    def take(self, count: int, first: int, keep: int) -> torch.Tensor:
        """Advance by `count` windows; returns windows [first, first + keep) of them, LongTensor[keep, window_len]."""

    @abstractmethod
    def samples_per_pass(self) -> int:
        """Whole windows in one pass over the data (DataError for a source that never ends)."""

    @abstractmethod
    def state_dict(self) -> dict[str, int]:
        """The position in the global order, as ints."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state` (keys as `state_dict` gives them)."""

    def start_workers(self) -> None:
        """Start the worker processes this source loads with, if any (called in the consumer's thread)."""

    def interrupt(self, stopping: bool) -> None:
        """Set (True) or clear the request that a `take` waiting in the background gives up (raises Stopped)."""

    def stop_workers(self) -> None:
        """Stop this source's worker processes, if any."""


class PackedSamples(SampleSource):
    """The packer's windows over a document source, in the source's order, epoch after epoch.

    `num_workers` > 0 tokenizes in that many worker processes (workers.py) started by `start_workers`; else the
    caller's thread tokenizes. With `interruptible`, a background `take` gives up at the next document once
    `interrupt(True)` is called.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        window_len: int,
        *,
        num_workers: int = 0,
        prefetch: int = 2,
        interruptible: bool = False,
    ):
        self.source, self.tokenizer, self.window_len = source, tokenizer, window_len
        self.description = source.description
        self.num_workers, self._prefetch = num_workers, prefetch
        self._pool: TokenizerPool | None = None
        self._stopping = threading.Event()
        tokenized = self._tokenized if (interruptible or num_workers) else None
        self.packer = SequencePacker(source, tokenizer, window_len, tokenized)

    def _tokenized(self, epoch: int, start: int) -> Iterator[tuple[int, int, np.ndarray]]:
        if self._pool is not None:
            return self._pool.stream(epoch, start, self._stopping)
        return self._interruptible(tokenized_passes(self.source, self.tokenizer, epoch, start))

    def _interruptible(self, documents: Iterator[tuple[int, int, np.ndarray]]) -> Iterator[tuple[int, int, np.ndarray]]:
        for document in documents:
            if self._stopping.is_set():
                raise Stopped
            yield document

    def take(self, count: int, first: int, keep: int) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, self.window_len, dtype=torch.long)
        return self.packer.next_windows(count)[first : first + keep]

    def samples_per_pass(self) -> int:
        return windows_per_pass(self.source, self.tokenizer, self.window_len)

    def state_dict(self) -> dict[str, int]:
        return self.packer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.packer.load_state_dict({key: int(state[key]) for key in PACKER_STATE_KEYS})

    def start_workers(self) -> None:
        if self.num_workers and self._pool is None:
            self._pool = TokenizerPool(self.source, self.tokenizer, self.num_workers, self._prefetch)

    def interrupt(self, stopping: bool) -> None:
        if stopping:
            self._stopping.set()
        else:
            self._stopping.clear()

    def stop_workers(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()


class TokenSamples(SampleSource):
    """Windows of a pre-tokenized dataset: window w of a pass is tokens [w·W, (w+1)·W) of its stream.

    A pass holds num_tokens // W windows (the last partial window of the stream is left out). Epoch e takes them
    in the order of `Permutation(windows, *shuffle_keys, e)`, or in stream order when `shuffle_keys` is None.
    Reading sample i of the global order costs one permutation lookup and one memory-mapped read.
    """

    def __init__(self, shards: TokenShards, window_len: int, shuffle_keys: tuple[object, ...] | None):
        self.shards, self.window_len, self.shuffle_keys = shards, window_len, shuffle_keys
        self.per_pass = shards.num_tokens // window_len
        order = "shuffled each epoch" if shuffle_keys is not None else "in order"
        self.description = f"{shards.description}, {self.per_pass:,} windows of {window_len} tokens per pass, {order}"
        if self.per_pass == 0:
            raise DataError(
                f"{shards.description} holds fewer than {window_len} tokens, one window of seq_len + 1; lower the "
                "seq_len or tokenize more data"
            )
        self.consumed = 0
        self._orders: dict[int, Permutation] = {}

    def _windows(self, samples: np.ndarray) -> np.ndarray:
        """The stream window of each global sample index."""
        epochs, within = np.divmod(samples, self.per_pass)
        if self.shuffle_keys is None:
            return within
        windows = np.empty_like(within)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            windows[chosen] = self._order(int(epoch))[within[chosen]]
        return windows

    def _order(self, epoch: int) -> Permutation:
        if epoch not in self._orders:
            self._orders = {epoch: Permutation(self.per_pass, *self.shuffle_keys, epoch)}  # one epoch at a time
        return self._orders[epoch]

    def take(self, count: int, first: int, keep: int) -> torch.Tensor:
        samples = self.consumed + first + np.arange(keep, dtype=np.int64)
        rows = [self.shards.read(int(w) * self.window_len, self.window_len) for w in self._windows(samples)]
        self.consumed += count
        if not rows:
            return torch.empty(0, self.window_len, dtype=torch.long)
        return torch.from_numpy(np.stack(rows))

    def samples_per_pass(self) -> int:
        return self.per_pass

    def state_dict(self) -> dict[str, int]:
        epoch, sample = divmod(self.consumed, self.per_pass)
        return {"epoch": epoch, "epoch_sample": sample}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sample = int(state["epoch_sample"])
        if not 0 <= sample < self.per_pass:
            raise DataError(
                f"{self.shards.description} changed since the checkpoint: it was at sample {sample} of an epoch, "
                f"this dataset has {self.per_pass} per epoch; resume with the same dataset and seq_len, or skip the "
                "data loader's state with checkpoint.exclude_from_loading"
            )
        self.consumed = int(state["epoch"]) * self.per_pass + sample
