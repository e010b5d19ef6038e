"""The training data loader: each data-parallel rank's slice of one global stream of packed sequences.

Microbatch k of a run is global sequences [k * dp_size * lbs, (k + 1) * dp_size * lbs) of the packer's stream,
and rank r takes the lbs sequences starting at r * lbs. So the global batch, and with it the loss curve, is the
same whatever the number of ranks sharing it. The price is that every rank tokenizes the whole global batch and
keeps only its slice; tokenizing is cheap next to a training step, and it keeps every rank's state identical.

With document masking (``training.attention_mask = "block_causal"``) a batch also carries ``document_ids``, computed
from the window alone, so the loader's state is the same with and without it.

Background loading (``training.dataloader``) makes batches ahead of the step in a thread, which with
``num_workers > 0`` packs documents that worker processes tokenized (workers.py). The batches are the same either
way, and the state describes the batches handed out, not those made ahead: a checkpoint resumes at the next batch
the training loop would have taken.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from dtrain.config.schema import DataLoader as DataLoaderConfig
from dtrain.config.schema import Training
from dtrain.data.background import Prefetcher, Stopped
from dtrain.data.packing import PACKER_STATE_KEYS, SequencePacker, tokenized_passes
from dtrain.data.sources import DocumentSource, build_source
from dtrain.data.tokenizer import Tokenizer
from dtrain.data.workers import TokenizerPool
from dtrain.errors import DataError

STATE_KEYS = ("sequences_consumed",) + PACKER_STATE_KEYS
# Batches made ahead of the step when training.dataloader.prefetch_factor is unset (torch's DataLoader default).
DEFAULT_PREFETCH_FACTOR = 2


def document_ids(input_ids: torch.Tensor, bos_id: int) -> torch.Tensor:
    """The document of each token within its window, ``[batch, seq]``: a new one starts at every BOS.

    Tokens before a window's first BOS (the end of a document begun in an earlier window) are document 0.
    """
    return (input_ids == bos_id).cumsum(dim=1)


class _Batches:
    """Makes this rank's batches from the packer, each with the loader's global state right after it."""

    def __init__(
        self, packer: SequencePacker, local_batch_size: int, dp_rank: int, dp_size: int, bos_id: int | None, pin: bool
    ):
        self.packer, self.local_batch_size, self.dp_rank, self.dp_size = packer, local_batch_size, dp_rank, dp_size
        self.bos_id, self.pin = bos_id, pin
        self.sequences = 0

    def next(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        global_batch = self.packer.next_windows(self.dp_size * self.local_batch_size)
        self.sequences += len(global_batch)
        start = self.dp_rank * self.local_batch_size
        windows = global_batch[start : start + self.local_batch_size]
        batch = {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}
        if self.bos_id is not None:
            batch["document_ids"] = document_ids(batch["input_ids"], self.bos_id)
        if self.pin:
            batch = {key: value.pin_memory() for key, value in batch.items()}
        return batch, self.state()

    def state(self) -> dict[str, int]:
        return {"sequences_consumed": self.sequences, **self.packer.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.sequences = int(state["sequences_consumed"])
        self.packer.load_state_dict({key: int(state[key]) for key in PACKER_STATE_KEYS})


class _Background:
    """The thread that makes batches ahead of the consumer and, with num_workers > 0, the worker processes that
    tokenize for it. Both start at the first batch asked for; it holds no reference to the DataLoader, so that
    dropping the loader can stop them."""

    def __init__(self, config: DataLoaderConfig, source: DocumentSource, tokenizer: Tokenizer):
        self.source, self.tokenizer = source, tokenizer
        self.batches: _Batches | None = None  # set by the DataLoader, whose packer may read `tokenized`
        self.num_workers, self.persistent_workers = config.num_workers, config.persistent_workers
        self.depth = config.prefetch_factor or DEFAULT_PREFETCH_FACTOR
        self._prefetcher: Prefetcher | None = None
        self._pool: TokenizerPool | None = None
        # Set while stopping: the loading thread then leaves the batch in hand at the next document.
        self._stopping = threading.Event()

    def tokenized(self, epoch: int, start: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """The packer's tokenized documents: from the worker processes, or tokenized in the loading thread."""
        if self._pool is not None:
            return self._pool.stream(epoch, start, self._stopping)
        return self._interruptible(tokenized_passes(self.source, self.tokenizer, epoch, start))

    def _interruptible(self, documents: Iterator[tuple[int, int, np.ndarray]]) -> Iterator[tuple[int, int, np.ndarray]]:
        for document in documents:
            if self._stopping.is_set():
                raise Stopped
            yield document

    def next(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        if self._prefetcher is None:
            if self.num_workers and self._pool is None:
                # Started here, in the consumer's thread, not in the loading thread.
                self._pool = TokenizerPool(self.source, self.tokenizer, self.num_workers, self.depth)
            self._prefetcher = Prefetcher(self.batches.next, self.depth, name="dtrain-data-loading")
        return self._prefetcher.next()

    def stop(self, keep_workers: bool) -> None:
        """Stop making batches (what was made ahead is dropped); stop the workers too unless `keep_workers`."""
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            self._stopping.set()
            if threading.current_thread().name == "dtrain-data-loading":
                prefetcher.stopping.set()  # a garbage collection ran the finalizer in the thread itself
            else:
                prefetcher.close()
            self._stopping.clear()
        if self._pool is not None and not keep_workers:
            pool, self._pool = self._pool, None
            pool.close()


class DataLoader:
    """An endless iterator of `{"input_ids", "labels"}` LongTensor[lbs, seq_len] CPU batches; DCP-Stateful.

    With `document_masking` a batch also holds `"document_ids"` LongTensor[lbs, seq_len] (see `document_ids`).
    Its state is global (the same on every rank) and made of plain ints: global sequences consumed and the
    packer's position. Loading it continues with exactly the next global sequences, also under another dp_size.

    `background` (training.dataloader) makes batches ahead of the step: a thread keeping `prefetch_factor` batches
    ready, fed by `num_workers` tokenizing processes when that is above 0. None makes each batch when it is asked
    for, in the caller's thread. `persistent_workers` keeps the worker processes when the loader is rewound with
    `load_state_dict` (a validation loader going back to its start, a resume); without it they are stopped then and
    new ones start with the next batch. `close()` stops the thread and the workers now; the loader closes itself
    when it is dropped and at exit.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        document_masking: bool = False,
        *,
        background: DataLoaderConfig | None = None,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        self.source, self.seq_len, self.local_batch_size = source, seq_len, local_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        # Pinned memory only speeds host-to-GPU copies: without CUDA there is nothing to gain (and pin_memory()
        # would fail), so pin_memory does nothing on a CPU-only machine.
        pin = background is not None and background.pin_memory and torch.cuda.is_available()
        self._background = _Background(background, source, tokenizer) if background is not None else None
        # Windows of seq_len + 1 tokens: inputs are the first seq_len, labels the last seq_len (shifted by one).
        packer = SequencePacker(source, tokenizer, seq_len + 1, self._background and self._background.tokenized)
        bos_id = tokenizer.bos_id if document_masking else None
        self._batches = _Batches(packer, local_batch_size, dp_rank, dp_size, bos_id, pin)
        if self._background is not None:
            self._background.batches = self._batches
            weakref.finalize(self, self._background.stop, False)
        self._consumed = self._batches.state()

    @property
    def sequences_consumed(self) -> int:
        """Global sequences handed out so far (by all ranks together)."""
        return self._consumed["sequences_consumed"]

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch, self._consumed = (self._background or self._batches).next()
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out (batches made ahead in the background do not count)."""
        return dict(self._consumed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [key for key in STATE_KEYS if key not in state_dict]
        if missing:
            raise DataError(
                f"data loader state lacks {', '.join(missing)} (has {', '.join(state_dict) or 'nothing'}); "
                "the checkpoint was not written by this data loader"
            )
        if self._background is not None:
            self._background.stop(keep_workers=self._background.persistent_workers)
        self._batches.load(state_dict)
        self._consumed = self._batches.state()

    def close(self) -> None:
        """Stop background loading and its workers now. A later batch starts them again, at the position of the
        state (the batches made ahead are made again)."""
        if self._background is not None:
            self._background.stop(keep_workers=False)
            self._batches.load(self._consumed)

    def __repr__(self) -> str:
        loading = "in the caller's thread"
        if self._background is not None:
            loading = f"{self._background.depth} batches ahead, {self._background.num_workers} worker processes"
        return (
            f"DataLoader({self.source.description}, seq_len={self.seq_len}, local_batch_size={self.local_batch_size}, "
            f"dp_rank={self.dp_rank}, dp_size={self.dp_size}, {loading})"
        )


def build_dataloader(training: Training, tokenizer: Tokenizer, dp_rank: int, dp_size: int, *, seed: int) -> DataLoader:
    """The data loader of `training.dataset` for data-parallel rank `dp_rank` of `dp_size`.

    `seed` (debug.seed) drives the synthetic source. Fails now, with a DataError, when the source is missing or
    holds no documents, rather than at the first step.
    """
    source = build_source(training, tokenizer, seed=seed)
    if next(source.documents(0), None) is None:
        raise DataError(f"{source.description} holds no documents; check training.dataset and training.dataset_path")
    return DataLoader(
        source,
        tokenizer,
        training.seq_len,
        training.local_batch_size,
        dp_rank,
        dp_size,
        document_masking=training.attention_mask == "block_causal",
        background=training.dataloader,
    )
