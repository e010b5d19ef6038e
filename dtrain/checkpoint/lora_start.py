"""The start-up of a LoRA run's weights (restore.py calls these): the frozen base of an adapter-only checkpoint
from its reference, which weights a checkpoint load fills, the reference this run's own checkpoints will record,
and the adapters of lora.initial_adapter_path (a PEFT folder) on an initial load."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.folders import COMMIT_FILE
from dtrain.checkpoint.lora_base import base_reference, check_base_reference
from dtrain.checkpoint.peft_names import is_lora

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


def load_base(ctx: RunContext, checkpoint: Path, base: dict[str, Any], load_weights: Callable[..., None]) -> None:
    """Load the frozen base that adapter-only `checkpoint` refers to, after checking it is still the same.

    `load_weights` is restore.py's DCP weight load (passed in: restore calls this module)."""
    from dtrain.checkpoint.spellings import family_spellings

    path = check_base_reference(checkpoint, base)
    if base["in_hf"]:
        from dtrain.checkpoint.hf_io import build_adapter, load_hf_weights

        load_hf_weights(ctx.state.model_parts, path, build_adapter(ctx.model.name, ctx.model_args), ctx.group)
    elif (path / COMMIT_FILE).is_file():  # as the initial load read it, partially where it was allowed to
        load_weights(ctx, path, partial=ctx.checkpoint.initial_load_partial)
    else:  # a base checkpoint from elsewhere
        load_weights(ctx, path, family_spellings(ctx.model.name, ctx.model_args), ctx.checkpoint.initial_load_writer,
                     partial=ctx.checkpoint.initial_load_partial)
    logger.info(f"checkpoint: frozen base weights of {checkpoint.name} loaded from {path}")


def start_lora(ctx: RunContext, rule: str, path: Path, source: str, base: dict[str, Any] | None) -> None:
    """After a resume or initial load of a LoRA run from `path` (read as `source`): set the base its checkpoints
    refer to (`base`: the one the loaded checkpoint referred to), and load lora.initial_adapter_path's adapters on
    an initial load."""
    if rule == "resume":
        ctx.base = base
        return
    ctx.base = base or base_reference(path, in_hf=source == "hf")
    if ctx.lora.initial_adapter_path:
        load_initial_adapter(ctx, Path(ctx.lora.initial_adapter_path))


def load_initial_adapter(ctx: RunContext, path: Path) -> None:
    from dtrain.checkpoint.hf_io import build_adapter
    from dtrain.checkpoint.peft_import import load_peft_adapter
    from dtrain.parallelize import get_family
    from dtrain.precision.lora import apply_lora

    # Every LoRA tensor of the whole model (a pipeline rank holds only its stages'), on the meta device: free.
    with torch.device("meta"):
        whole = get_family(ctx.model.name).model.model_cls(ctx.model_args)
    apply_lora(whole, ctx.lora)
    fqns = [fqn for fqn in whole.state_dict() if is_lora(fqn)]
    load_peft_adapter(ctx.state.model_parts, path, ctx.lora, build_adapter(ctx.model.name, ctx.model_args), fqns)
    logger.info(f"lora: adapters loaded from {path} (PEFT, lora.initial_adapter_path)")
