"""Load model weights from a DCP checkpoint (full or model-only), resharded to this layout: the weights it fills,
their stored names (ours, or another writer's spelling: spellings.py), read straight into this rank's shards where
stored as ours, else whole and converted."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.dcp_read import read_dcp
from dtrain.checkpoint.load_checks import first_non_finite, fitting_weights
from dtrain.checkpoint.peft_names import is_lora
from dtrain.checkpoint.spellings import find_spelling, model_fqns, whole_tensor_batches
from dtrain.errors import DtrainError
from dtrain.models.family import WeightSpelling

logger = logging.getLogger("dtrain")


def lora_weights(
    weights: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], prefix: str, adapters_only: bool
) -> dict[str, torch.Tensor]:
    """Which of the model's `weights` a DCP checkpoint (`shapes`, its weights under `prefix`) fills: only the
    LoRA adapters from an adapter-only one; everything else but the adapters a base model's checkpoint lacks (they
    keep their init)."""
    if adapters_only:
        return {fqn: t for fqn, t in weights.items() if is_lora(fqn)}
    return {fqn: t for fqn, t in weights.items() if not is_lora(fqn) or prefix + fqn in shapes}


def load_weights(
    ctx: RunContext, path: Path, spellings: tuple[WeightSpelling, ...] = (), writer: str = "dtrain",
    adapters_only: bool = False, partial: bool = False,
) -> None:
    """Load the model weights (resharded to this layout) from a full or model-only DCP checkpoint, named as ours
    or as one of `spellings`, as `writer` (checkpoint.initial_load_writer) and the names decide (spellings.py).

    Only LoRA adapters when `adapters_only`; adapters a checkpoint lacks (a base model's) keep their init. Any other
    weight the checkpoint holds and the model does not take, or the reverse, is refused unless `partial`
    (checkpoint.initial_load_partial; load_checks.py); so is a NaN or Inf in a loaded weight."""
    shapes = dcp_io.read_tensor_shapes(path)
    prefix = dcp_io.weights_prefix(shapes)
    weights = lora_weights(dcp_io.model_state_dict(ctx.state.model_parts), shapes, prefix, adapters_only)
    whole_model = model_fqns(weights, ctx.group)
    spelling = None
    if spellings:
        spelling = find_spelling(shapes, prefix, whole_model, spellings, writer, path)
    name = spelling.stored_name if spelling else (lambda fqn: fqn)
    weights = fitting_weights(path, shapes, prefix, weights, whole_model, name, partial)
    dcp_io.check_weights_fit(path, shapes, prefix, weights, name)
    if spelling:
        logger.info(f"checkpoint: {path} names the weights as {spelling.writer} does")
    stored = {fqn: prefix + name(fqn) for fqn in weights}
    # Tensors stored as ours load straight into this rank's shards; the others are read whole and converted.
    as_stored = [fqn for fqn in weights if spelling is None or spelling.to_ours(fqn) is None]
    wanted = {stored[fqn]: weights[fqn] for fqn in as_stored}
    read_dcp(wanted, path)
    loaded = {fqn: wanted[stored[fqn]] for fqn in as_stored}
    for batch in whole_tensor_batches([fqn for fqn in weights if fqn not in loaded], weights, ctx.group):
        whole = {stored[fqn]: torch.empty(shapes[stored[fqn]], dtype=weights[fqn].dtype) for fqn in batch}
        read_dcp(whole, path)
        for fqn in batch:
            loaded[fqn] = dcp_io.place_like(spelling.to_ours(fqn)(whole[stored[fqn]]), weights[fqn])
    bad = first_non_finite(loaded, whole_model, ctx.group)
    if bad is not None:
        raise DtrainError(f"checkpoint {path}: {prefix}{name(bad)} holds NaN or Inf values; a checkpoint to start "
                          "from must be finite (was it saved from a diverged run, or damaged?)")
    dcp_io.set_model_weights(ctx.state.model_parts, loaded)
