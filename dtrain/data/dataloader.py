"""The training data loader: each data-parallel rank's slice of one global stream of packed sequences.

Microbatch k of a run is global sequences [k * dp_size * lbs, (k + 1) * dp_size * lbs) of the packer's stream,
and rank r takes the lbs sequences starting at r * lbs. So the global batch, and with it the loss curve, is the
same whatever the number of ranks sharing it. The price is that every rank tokenizes the whole global batch and
keeps only its slice; tokenizing is cheap next to a training step, and it keeps every rank's state identical.

With document masking (``training.attention_mask = "block_causal"``) a batch also carries ``document_ids``, computed
from the window alone, so the loader's state is the same with and without it.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.config.schema import Training
from dtrain.data.packing import PACKER_STATE_KEYS, SequencePacker
from dtrain.data.sources import DocumentSource, build_source
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError

STATE_KEYS = ("sequences_consumed",) + PACKER_STATE_KEYS


def document_ids(input_ids: torch.Tensor, bos_id: int) -> torch.Tensor:
    """The document of each token within its window, ``[batch, seq]``: a new one starts at every BOS.

    Tokens before a window's first BOS (the end of a document begun in an earlier window) are document 0.
    """
    return (input_ids == bos_id).cumsum(dim=1)


class DataLoader:
    """An endless iterator of `{"input_ids", "labels"}` LongTensor[lbs, seq_len] CPU batches; DCP-Stateful.

    With `document_masking` a batch also holds `"document_ids"` LongTensor[lbs, seq_len] (see `document_ids`).
    Its state is global (the same on every rank) and made of plain ints: global sequences consumed and the
    packer's position. Loading it continues with exactly the next global sequences, also under another dp_size.
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
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        self.source, self.seq_len, self.local_batch_size = source, seq_len, local_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.bos_id = tokenizer.bos_id if document_masking else None
        # Windows of seq_len + 1 tokens: inputs are the first seq_len, labels the last seq_len (shifted by one).
        self._packer = SequencePacker(source, tokenizer, seq_len + 1)
        self.sequences_consumed = 0

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        global_batch = self._packer.next_windows(self.dp_size * self.local_batch_size)
        self.sequences_consumed += len(global_batch)
        start = self.dp_rank * self.local_batch_size
        windows = global_batch[start : start + self.local_batch_size]
        batch = {"input_ids": windows[:, :-1].contiguous(), "labels": windows[:, 1:].contiguous()}
        if self.bos_id is not None:
            batch["document_ids"] = document_ids(batch["input_ids"], self.bos_id)
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"sequences_consumed": self.sequences_consumed, **self._packer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [key for key in STATE_KEYS if key not in state_dict]
        if missing:
            raise DataError(
                f"data loader state lacks {', '.join(missing)} (has {', '.join(state_dict) or 'nothing'}); "
                "the checkpoint was not written by this data loader"
            )
        self.sequences_consumed = int(state_dict["sequences_consumed"])
        self._packer.load_state_dict({key: int(state_dict[key]) for key in PACKER_STATE_KEYS})

    def __repr__(self) -> str:
        return (
            f"DataLoader({self.source.description}, seq_len={self.seq_len}, local_batch_size={self.local_batch_size}, "
            f"dp_rank={self.dp_rank}, dp_size={self.dp_size})"
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
    )
