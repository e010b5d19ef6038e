"""The training data loader: each data-parallel rank's slice of one global order of fixed-length samples.

Rank r of D takes samples [r·lbs, (r+1)·lbs) of each global microbatch, so the batches (and the loss curve) do not
depend on D. Samples come from one sample source (samples.py) or several mixed by weight (mixture.py), made ahead
of the step in the background; the state counts the batches handed out, so a resume continues at the next one.
docs/data.md describes the sharding, background loading and resume rules.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Union

import torch

from dtrain.config.dataset_mixture import MIXABLE_KINDS, parse_mixture
from dtrain.config.schema import DataLoader as DataLoaderConfig
from dtrain.config.schema import Training
from dtrain.data.background import Prefetcher
from dtrain.data.chat_packing import build_chat_samples, chat_batch
from dtrain.data.mixture import Interleave, source_names
from dtrain.data.preference_samples import build_preference_samples, preference_batch
from dtrain.data.samples import PackedSamples, SampleSource, TokenSamples
from dtrain.data.source_factory import build_source
from dtrain.data.sources import DocumentSource
from dtrain.data.token_shards import TokenShards
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError

# Batches made ahead of the step when training.dataloader.prefetch_factor is unset (torch's DataLoader default).
DEFAULT_PREFETCH_FACTOR = 2
# What a loader reads: a document source (packed here), a sample source, or several of either with weights.
Source = Union[DocumentSource, SampleSource]


def document_ids(input_ids: torch.Tensor, bos_id: int) -> torch.Tensor:
    """The document of each token within its window, ``[batch, seq]``: a new one starts at every BOS.

    Tokens before a window's first BOS (the end of a document begun in an earlier window) are document 0.
    """
    return (input_ids == bos_id).cumsum(dim=1)


class _Batches:
    """Makes this rank's batches from the sample sources, each with the loader's global state right after it."""

    def __init__(
        self,
        sources: list[SampleSource],
        weights: Sequence[float] | None,
        window_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        bos_id: int | None,
        pin: bool,
    ):
        self.sources, self.window_len = sources, window_len
        self.interleave = Interleave(list(weights)) if len(sources) > 1 else None
        self.local_batch_size, self.dp_rank, self.dp_size = local_batch_size, dp_rank, dp_size
        self.bos_id, self.pin = bos_id, pin
        self.sequences = 0

    def _windows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's windows, and the source of each (None: one source)."""
        count, first, keep = self.dp_size * self.local_batch_size, self.dp_rank * self.local_batch_size, self.local_batch_size
        if self.interleave is None:
            return self.sources[0].take(count, first, keep), None
        # Each source hands out its samples of the global batch in its own order; this rank's are a run of them.
        owners = torch.from_numpy(self.interleave.sources(self.sequences, count))
        mine = owners[first : first + keep]
        windows = torch.empty(keep, self.window_len, dtype=torch.long)
        for index, source in enumerate(self.sources):
            ours = mine == index
            taken = source.take(int((owners == index).sum()), int((owners[:first] == index).sum()), int(ours.sum()))
            windows[ours] = taken
        return windows, mine

    def next(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        windows, owners = self._windows()
        self.sequences += self.dp_size * self.local_batch_size
        if windows.dim() == 3:  # chat windows carry their targets and documents (chat_packing.py)
            batch = chat_batch(windows, document_masking=self.bos_id is not None)
        elif windows.dim() == 4:  # preference pairs: a chosen and a rejected sequence each (preference_samples.py)
            batch = preference_batch(windows)
        else:
            batch = {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}
        if owners is not None:  # a mixture: each label's source, for the step's per-source loss (source_loss.py)
            batch["source_ids"] = owners[:, None].expand_as(batch["labels"]).contiguous()
        if self.bos_id is not None and "document_ids" not in batch:
            batch["document_ids"] = document_ids(batch["input_ids"], self.bos_id)
        if self.pin:
            batch = {key: value.pin_memory() for key, value in batch.items()}
        return batch, self.state()

    def _prefix(self, index: int) -> str:
        # One source keeps its keys as they are (the state of a loader before mixtures existed); a mixture's
        # sources are told apart by their index.
        return "" if len(self.sources) == 1 else f"source{index}_"

    def state(self) -> dict[str, int]:
        state = {"sequences_consumed": self.sequences}
        for index, source in enumerate(self.sources):
            state.update({self._prefix(index) + key: value for key, value in source.state_dict().items()})
        return state

    def load(self, state: dict[str, Any]) -> None:
        self.sequences = int(state["sequences_consumed"])
        for index, source in enumerate(self.sources):
            prefix = self._prefix(index)
            source.load_state_dict({key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)})


class _Background:
    """The thread that makes batches ahead of the consumer, and the sources' worker processes. Both start at the
    first batch asked for; it holds no reference to the DataLoader, so that dropping the loader can stop them."""

    def __init__(self, config: DataLoaderConfig, batches: _Batches):
        self.batches = batches
        self.num_workers, self.persistent_workers = config.num_workers, config.persistent_workers
        self.depth = config.prefetch_factor or DEFAULT_PREFETCH_FACTOR
        self._prefetcher: Prefetcher | None = None

    def next(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        if self._prefetcher is None:
            for source in self.batches.sources:
                source.start_workers()  # here, in the consumer's thread, not in the loading thread
            self._prefetcher = Prefetcher(self.batches.next, self.depth, name="dtrain-data-loading")
        return self._prefetcher.next()

    def stop(self, keep_workers: bool) -> None:
        """Stop making batches (what was made ahead is dropped); stop the workers too unless `keep_workers`."""
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            for source in self.batches.sources:
                source.interrupt(True)  # the loading thread leaves the batch in hand at the next document
            if threading.current_thread().name == "dtrain-data-loading":
                prefetcher.stopping.set()  # a garbage collection ran the finalizer in the thread itself
            else:
                prefetcher.close()
            for source in self.batches.sources:
                source.interrupt(False)
        if not keep_workers:
            for source in self.batches.sources:
                source.stop_workers()


class DataLoader:
    """An endless iterator of `{"input_ids", "labels"}` LongTensor[lbs, seq_len] CPU batches; DCP-Stateful.

    `source` is a document source (packed here), a sample source (e.g. a pre-tokenized dataset's `TokenSamples`),
    or a list of them mixed by `weights` (mixture.py), named `names` in the metrics (default `source0`, ...); a
    mixture's batch also holds `"source_ids"` LongTensor[lbs, seq_len], each label's source index. With
    `document_masking` a batch also holds `"document_ids"` LongTensor[lbs, seq_len] (see `document_ids`). Its
    state is global (the same on every rank) and made of plain ints: global sequences consumed and each source's
    position. Loading it continues with exactly the next global sequences, also under another dp_size.

    `background` (training.dataloader) makes batches ahead of the step: a thread keeping `prefetch_factor` batches
    ready, fed by `num_workers` tokenizing processes per document source when that is above 0. None makes each
    batch when it is asked for, in the caller's thread. `persistent_workers` keeps the worker processes when the
    loader is rewound with `load_state_dict` (a validation loader going back to its start, a resume); without it
    they are stopped then and new ones start with the next batch. `close()` stops the thread and the workers now;
    the loader closes itself when it is dropped and at exit.
    """

    def __init__(
        self,
        source: Source | Sequence[Source],
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        document_masking: bool = False,
        *,
        background: DataLoaderConfig | None = None,
        weights: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        sources = list(source) if isinstance(source, (list, tuple)) else [source]
        if len(sources) > 1 and (weights is None or len(weights) != len(sources)):
            raise ValueError(f"{len(sources)} sources need as many weights, got {weights!r}")
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        # Under which names a mixture's sources are logged; empty for one source (no per-source metrics).
        self.source_names = tuple(names or (f"source{i}" for i in range(len(sources)))) if len(sources) > 1 else ()
        self.dp_rank, self.dp_size = dp_rank, dp_size
        depth = (background.prefetch_factor if background else None) or DEFAULT_PREFETCH_FACTOR
        # Windows of seq_len + 1 tokens: inputs are the first seq_len, labels the last seq_len (shifted by one).
        self.sources = [
            item
            if isinstance(item, SampleSource)
            else PackedSamples(
                item, tokenizer, seq_len + 1, num_workers=background.num_workers if background else 0,
                prefetch=depth, interruptible=background is not None,
            )
            for item in sources
        ]
        # Pinned memory only speeds host-to-GPU copies: without CUDA there is nothing to gain (and pin_memory()
        # would fail), so pin_memory does nothing on a CPU-only machine.
        pin = background is not None and background.pin_memory and torch.cuda.is_available()
        bos_id = tokenizer.bos_id if document_masking else None
        self._batches = _Batches(self.sources, weights, seq_len + 1, local_batch_size, dp_rank, dp_size, bos_id, pin)
        self._background = _Background(background, self._batches) if background is not None else None
        if self._background is not None:
            weakref.finalize(self, self._background.stop, False)
        self._consumed = self._batches.state()

    @property
    def sequences_consumed(self) -> int:
        """Global sequences handed out so far (by all ranks together)."""
        return self._consumed["sequences_consumed"]

    @property
    def description(self) -> str:
        """What the loader reads: its source, or each source of a mixture with its share."""
        if self._batches.interleave is None:
            return self.sources[0].description
        shares = self._batches.interleave.counts / self._batches.interleave.counts.sum()
        return "mixture of " + "; ".join(f"{share:.1%} {s.description}" for share, s in zip(shares, self.sources))

    def tokens_seen_by_source(self) -> dict[str, int]:
        """`tokens_seen/<name>` of each source of a mixture (none for one source): the tokens of its samples handed
        out so far by all ranks, counted as `tokens_seen` counts them. From the global sample index alone, so exact
        after a resume too."""
        if self._batches.interleave is None:
            return {}
        samples = self._batches.interleave.samples_before(self.sequences_consumed)
        return {f"tokens_seen/{name}": int(n) * self.seq_len for name, n in zip(self.source_names, samples)}

    def samples_per_pass(self) -> int:
        """Whole samples in one pass over a single source (a validation set's size); reads a text source whole."""
        if len(self.sources) > 1:
            raise DataError("a mixture of datasets has no single pass; give one dataset")
        return self.sources[0].samples_per_pass()

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch, self._consumed = (self._background or self._batches).next()
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out (batches made ahead in the background do not count)."""
        return dict(self._consumed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [key for key in self._consumed if key not in state_dict]
        if missing:
            raise DataError(
                f"data loader state lacks {', '.join(missing)} (has {', '.join(state_dict) or 'nothing'}); "
                "the checkpoint was not written by a data loader of these datasets"
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
            f"DataLoader({self.description}, seq_len={self.seq_len}, local_batch_size={self.local_batch_size}, "
            f"dp_rank={self.dp_rank}, dp_size={self.dp_size}, {loading})"
        )


def build_sample_source(
    training: Training, tokenizer: Tokenizer, *, seed: int, split: str = "train", key: str = "training", index: int = 0,
    held_out: float = 0.0,
) -> Source:
    """The source of `training.dataset` (not a mixture): a pre-tokenized dataset's samples, or a document source
    that holds at least one document (else DataError now, rather than at the first step). `key` is the config
    section named in errors; `index` tells a mixture's pre-tokenized datasets' orders apart; `held_out` is the
    share of a chat dataset's rows that validation holds out (run/validation.py's `held_out_fraction`)."""
    if training.dataset == "chat":
        return build_chat_samples(training, tokenizer, split, held_out)
    if training.dataset == "preference":
        return build_preference_samples(training, tokenizer)
    if training.dataset == "tokens":
        shards = TokenShards(training.dataset_path, tokenizer, key=f"{key}.dataset_path")
        shuffle = (seed, "tokens", index) if training.dataset_shuffle else None
        return TokenSamples(shards, training.seq_len + 1, shuffle)
    source = build_source(training, tokenizer, seed=seed, split=split)
    if next(source.documents(0), None) is None:
        raise DataError(f"{source.description} holds no documents; check {key}.dataset and {key}.dataset_path")
    return source


def build_sample_sources(
    training: Training, tokenizer: Tokenizer, *, seed: int, held_out: float = 0.0
) -> tuple[list[Source], list[float] | None, list[str] | None]:
    """The sources of `training.dataset`, or of each entry of its `dataset_mixture` with their weights and names
    (None for one source)."""
    if training.dataset != "mixture":
        return [build_sample_source(training, tokenizer, seed=seed, held_out=held_out)], None, None
    entries = parse_mixture(training.dataset_mixture, MIXABLE_KINDS)
    sources = [
        build_sample_source(replace(training, dataset=entry.kind, dataset_path=entry.path), tokenizer, seed=seed,
                            index=index)
        for index, entry in enumerate(entries)
    ]
    return sources, [entry.weight for entry in entries], source_names(entries)


def check_training_data(training: Training, tokenizer: Tokenizer, *, seed: int) -> None:
    """The pre-flight's data check: the sources are built as the loader builds them, and dropped. Each refuses at
    once what it can know without training (a missing path, a foreign or damaged manifest, an empty dataset, a chat
    row that does not render, no conversation that trains within seq_len + 1), so that it is refused before the
    run folder is touched, not after its config.toml, metrics and TensorBoard files are written."""
    build_sample_sources(training, tokenizer, seed=seed)


def build_dataloader(
    training: Training, tokenizer: Tokenizer, dp_rank: int, dp_size: int, *, seed: int, held_out: float = 0.0
) -> DataLoader:
    """The data loader of `training.dataset` (or of its `dataset_mixture`) for data-parallel rank `dp_rank` of
    `dp_size`. `seed` (debug.seed) drives the synthetic source and the order of pre-tokenized samples; `held_out`
    leaves out the chat rows validation holds out."""
    sources, weights, names = build_sample_sources(training, tokenizer, seed=seed, held_out=held_out)
    return DataLoader(
        sources,
        tokenizer,
        training.seq_len,
        training.local_batch_size,
        dp_rank,
        dp_size,
        document_masking=training.attention_mask == "block_causal",
        background=training.dataloader,
        weights=weights,
        names=names,
    )
