"""Validation: the loss on held-out data every `validation.freq` steps, forward only, on every parallel layout.

The held-out data is packed like training's (`[validation]` seq_len and local_batch_size, each data-parallel rank
its slice of every global batch) and read from its beginning at every evaluation, so each evaluation sees the same
batches and the curve measures the model, not the data. `validation.dataset = "builtin"` reads the part of the
built-in corpus that training never reads (data/sources.py); a validation source that is training's own data is
refused, and one that cannot be checked is named as such in the log.

`validation_loss` is a function of (state, batches) like `train_step`: forward only (the executor's `evaluate`:
the whole model, or the pipeline schedule's `eval`), model parts in eval mode without gradients, their buffers
(e.g. MoE load counts) left as training had them. The loss is the summed token cross-entropy of all batches on all
data- and context-parallel ranks over their valid tokens, as `train_step` normalises training's;
`val_perplexity = exp(val_loss)`. `Validator.run` reads the result on the host once per evaluation.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from dtrain.config.dataset_mixture import MIXABLE_KINDS, parse_mixture
from dtrain.config.schema import Training, Validation
from dtrain.data import DataLoader, Tokenizer
from dtrain.data.dataloader import Source, build_sample_source
from dtrain.errors import ConfigError, DataError
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.state import RankCoordinates, TrainState

logger = logging.getLogger("dtrain")

Batch = dict[str, torch.Tensor]


@contextlib.contextmanager
def evaluating(model_parts: list[nn.Module]):
    """Model parts in eval mode without gradients; afterwards back in their mode, with the buffers they had."""
    modes = [part.training for part in model_parts]
    saved = [(buffer, buffer.detach().clone()) for part in model_parts for buffer in part.buffers()]
    try:
        for part in model_parts:
            part.eval()
        with torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
        for part, mode in zip(model_parts, modes):
            part.train(mode)


def validation_loss(state: TrainState, batches: Iterable[Batch]) -> torch.Tensor:
    """The mean token cross-entropy of `batches` (this rank's part of each global batch) over all data- and
    context-parallel ranks: a 0-dim float64 tensor, the same on every rank; nothing is read on the host."""
    rank = state.setup.rank
    totals = None  # [summed loss, valid tokens] of this rank's batches
    with evaluating(state.model_parts):
        for batch in batches:
            if rank.shard_sequence is not None:  # context parallel: this rank's tokens of every sequence
                batch = rank.shard_sequence(batch)
            loss_sum = state.setup.executor.evaluate(state.model_parts, batch)
            tokens = (batch["labels"] != IGNORE_INDEX).sum()
            pair = torch.stack([loss_sum.detach().double(), tokens.double()])
            totals = pair if totals is None else totals + pair
    if totals is None:
        raise ValueError("validation_loss needs at least one batch")
    totals = rank.reduce_over_dp(totals)
    return totals[0] / totals[1]


@dataclass
class Validator:
    """Evaluates `batches` batches of a fresh loader (`new_loader`, at the start of the validation set) every
    `freq` steps."""

    freq: int
    batches: int
    new_loader: Callable[[], Iterator[Batch]]
    device: torch.device

    def due(self, step: int) -> bool:
        return step > 0 and step % self.freq == 0

    def run(self, state: TrainState) -> dict[str, float]:
        """`{"val_loss", "val_perplexity"}` of the model in `state` (one host read)."""
        loader = self.new_loader()
        batches = (
            {key: value.to(self.device, non_blocking=True) for key, value in next(loader).items()}
            for _ in range(self.batches)
        )
        loss = validation_loss(state, batches)
        val_loss, val_perplexity = torch.stack([loss, loss.exp()]).tolist()
        return {"val_loss": val_loss, "val_perplexity": val_perplexity}


def held_out_fraction(training: Training, v: Validation) -> float:
    """The share of training's chat rows that validation holds out (training.chat.validation_fraction): where
    [validation] reads chat data and names no path of its own while training reads the user's chat data (not the
    bundled file); else 0. Training's loader and validation's both take it, so the held-out rows are validation's
    alone."""
    holds = v.enable and v.dataset == "chat" and not v.dataset_path and training.dataset == "chat"
    return training.chat.validation_fraction if holds and training.dataset_path else 0.0


def validation_data(v: Validation, training: Training) -> Training:
    """The `[training]` data fields as `[validation]` sets them, for the data functions that read them (holding
    out a share of training's chat data: training's path)."""
    path = training.dataset_path if held_out_fraction(training, v) else v.dataset_path
    return replace(
        training, dataset=v.dataset, dataset_path=path, seq_len=v.seq_len, local_batch_size=v.local_batch_size
    )


def check_not_training_data(training: Training, validation: Training, held_out: float = 0.0) -> str:
    """Refuse validation data that is training's own (same kind and path, or for files a path inside the other's)
    unless it is the share of it held out (`held_out`); returns what the log says about their overlap."""
    kind = validation.dataset
    if kind == "builtin":
        return "training never reads it"
    if kind == "synthetic":
        return "synthetic documents of another seed than training's"
    if kind == "chat" and not validation.dataset_path:
        return "the bundled held-out chat file, which training never reads"
    if held_out:
        return (f"{held_out:.0%} of training.dataset_path's conversations, held out "
                "(training.chat.validation_fraction): training never reads them")
    val_path = _data_path(kind, validation.dataset_path)
    # Training reads one dataset, or each entry of its mixture.
    if training.dataset == "mixture":
        parts = [(entry.kind, entry.path) for entry in parse_mixture(training.dataset_mixture, MIXABLE_KINDS)]
    else:
        parts = [(training.dataset, training.dataset_path)]
    for train_kind, given_path in parts:
        train_path = _data_path(train_kind, given_path)
        if kind == train_kind and (val_path == train_path or (kind == "files" and _nested(val_path, train_path))):
            raise ConfigError(
                f"validation.dataset = {kind} at validation.dataset_path {validation.dataset_path or val_path!r} "
                f"reads training's data ({given_path or train_path!r}); give held-out data, e.g. validation.dataset "
                "= c4_validation or builtin"
            )
    return "not checked for overlap with the training data beyond its path"


def _data_path(kind: str, path: str) -> str:
    if not path and kind in ("c4", "c4_validation"):
        from dtrain.data.hf_source import C4_DEFAULT_PATH

        path = C4_DEFAULT_PATH
    return os.path.realpath(path) if path else ""


def _nested(first: str, second: str) -> bool:
    return bool(first and second) and os.path.commonpath([first, second]) in (first, second)


def build_source_for_validation(v: Validation, training: Training, seed: int, tokenizer: Tokenizer) -> Source:
    """The validation source (`seed` is `debug.seed`); a problem with it is reported under the validation keys
    that name it."""
    try:
        return build_sample_source(
            validation_data(v, training), tokenizer, seed=seed, split="validation", key="validation",
            held_out=held_out_fraction(training, v),
        )
    except DataError as err:
        # The data functions name the [training] keys they read; here the [validation] keys gave them.
        raise DataError(str(err).replace("training.dataset", "validation.dataset")) from None


def build_validator(
    v: Validation, training: Training, seed: int, rank: RankCoordinates, tokenizer: Tokenizer,
    device: torch.device,
) -> Validator | None:
    """The validator of `[validation]` for this rank (None when it is off), beside `[training]`'s data and
    `debug.seed`; bad data fails here, at start-up."""
    if not v.enable:
        return None
    overlap = check_not_training_data(training, validation_data(v, training), held_out_fraction(training, v))
    source = build_source_for_validation(v, training, seed, tokenizer)
    # One loader, rewound to the start of the validation set for every evaluation: [validation.dataloader] loads
    # ahead in the background like training's, and with persistent_workers its worker processes stay alive.
    loader = DataLoader(
        source, tokenizer, v.seq_len, v.local_batch_size, rank.dp_rank, rank.dp_size,
        document_masking=training.attention_mask == "block_causal", background=v.dataloader,
    )
    global_batch = rank.dp_size * v.local_batch_size
    if v.steps > 0:
        batches, extent = v.steps, f"{v.steps} batch(es)"
    else:  # the whole set (config validation refuses -1 for a source that never ends): its full global batches
        batches = loader.samples_per_pass() // global_batch
        if batches == 0:
            raise DataError(
                f"validation: {source.description} holds fewer than one global batch of {global_batch} sequences of "
                f"{v.seq_len} tokens (validation.local_batch_size x data-parallel ranks); lower validation.seq_len "
                "or validation.local_batch_size"
            )
        extent = f"{batches} batch(es), the whole set"
    logger.info(
        "validation every %d steps: %s of %d x %d per dp rank from %s (%s)",
        v.freq, extent, v.local_batch_size, v.seq_len, source.description, overlap,
    )
    start = loader.state_dict()

    def new_loader() -> DataLoader:
        loader.load_state_dict(start)
        return loader

    return Validator(freq=v.freq, batches=batches, new_loader=new_loader, device=device)
