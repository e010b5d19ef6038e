"""What a weight load must not let through without a word.

- Weights that do not fit: a checkpoint weight the model does not take (a 6-layer checkpoint into 3 layers) or a
  model weight the checkpoint lacks would load a different model in part, so both are refused naming the first few,
  unless checkpoint.initial_load_partial asks for exactly that (then the log lists what was left out).
- Non-finite values: a NaN or Inf in a loaded weight would only show as a diverged loss at step 1, so it is refused
  at load, naming the file and tensor.

Every rank holds only some weights (shards, pipeline stages), so each decision is taken over the whole model's
names and agreed by all ranks: each gives the same one-line error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtrain.errors import DtrainError

if TYPE_CHECKING:
    from dtrain.checkpoint.folders import CommitRecord
    from dtrain.models.decoder import DecoderArgs

logger = logging.getLogger("dtrain")
SHOWN = 3  # names quoted in a one-line error
PARTIAL_HINT = "set checkpoint.initial_load_partial = true to load only the weights both have"


def named(names: list[str]) -> str:
    """The first few of `names`, and how many more there are."""
    more = f" (and {len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def fitting_weights(
    path: Path, shapes: dict[str, tuple[int, ...]], prefix: str, weights: dict[str, torch.Tensor],
    whole_model: list[str], stored_name: Callable[[str], str], partial: bool, way_out: str = PARTIAL_HINT,
) -> dict[str, torch.Tensor]:
    """Those of this rank's `weights` that the checkpoint at `path` holds (`shapes`, its weights under `prefix`,
    named by `stored_name`), after refusing a checkpoint that is not exactly the model's (`whole_model`: the FQNs of
    every rank's weights; the error ends with `way_out`) unless `partial` (checkpoint.initial_load_partial), which
    logs what is left out."""
    taken = {prefix + stored_name(fqn) for fqn in whole_model}
    unused = sorted(key.removeprefix(prefix) for key in shapes if key.startswith(prefix) and key not in taken)
    missing = [fqn for fqn in whole_model if prefix + stored_name(fqn) not in shapes]
    if not partial and missing:
        raise DtrainError(
            f"checkpoint {path} does not hold weight {named([stored_name(f) for f in missing])} of this model (a "
            f"different model.name/flavor/args, or not a model checkpoint); {way_out}"
        )
    if not partial and unused:
        raise DtrainError(
            f"checkpoint {path} holds {named(unused)}, which this model does not take (another model.flavor or "
            f"model.args); {way_out}"
        )
    if len(missing) == len(whole_model):
        raise DtrainError(f"checkpoint {path} holds none of this model's weights (checkpoint.initial_load_partial "
                          "loads those both have; there are none)")
    if unused:
        logger.warning(f"checkpoint: partial load (checkpoint.initial_load_partial): not loaded from {path}, "
                       f"which this model does not take: {', '.join(unused)}")
    if missing:
        logger.warning(f"checkpoint: partial load (checkpoint.initial_load_partial): not in {path}, kept at their "
                       f"initialisation: {', '.join(missing)}")
    return {fqn: t for fqn, t in weights.items() if prefix + stored_name(fqn) in shapes}


def first_non_finite(tensors: dict[str, torch.Tensor], order: list[str], group: dist.ProcessGroup | None) -> str | None:
    """The first name of `order` (the same list on every rank of `group`) whose tensor among this rank's `tensors`
    (whole, or this rank's shards) holds a NaN or Inf, on any rank; None where all are finite."""
    bad = (i for i, name in enumerate(order) if name in tensors and not _finite(tensors[name]))
    first = torch.tensor([next(bad, len(order))])
    if group is not None:
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    return order[int(first)] if int(first) < len(order) else None


def _finite(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return not local.is_floating_point() or bool(torch.isfinite(local).all())


def check_tying(path: Path, record: CommitRecord, model_args: DecoderArgs | None) -> None:
    """Refuse weights saved tied into an untied model and the reverse: names and shapes match either way, and
    the load would silently merge two weights into one or copy one into two."""
    saved, ours = record.tie_word_embeddings, getattr(model_args, "tie_word_embeddings", None)
    if saved is None or ours is None or saved == ours:
        return
    effect = "keep only one of its two weights" if ours else "copy its one shared weight into two"
    raise DtrainError(
        f"checkpoint {path} was saved with tie_word_embeddings {str(saved).lower()}, this model has "
        f"{str(ours).lower()}: loading it would {effect}; set model.tie_word_embeddings = {str(saved).lower()}"
    )
