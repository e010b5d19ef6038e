"""The start-up stages of a LoRA run's weights: the frozen base of an adapter-only checkpoint from its reference
(before the adapters are read), then the reference this run's own checkpoints will record and, on an initial load,
the adapters of lora.initial_adapter_path (a PEFT folder)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.folders import COMMIT_FILE
from dtrain.checkpoint.lora_base import base_reference, check_base_reference
from dtrain.checkpoint.peft_names import is_lora
from dtrain.checkpoint.spellings import family_spellings
from dtrain.checkpoint.startup_plan import Plan
from dtrain.checkpoint.weight_load import load_weights

logger = logging.getLogger("dtrain")


def load_lora_base(ctx: RunContext, plan: Plan) -> None:
    """Load the frozen base an adapter-only checkpoint refers to, after checking it is still the same."""
    if plan.lora_base is None:
        return
    path = check_base_reference(plan.path, plan.lora_base)
    if plan.lora_base["in_hf"]:
        from dtrain.checkpoint.hf_io import build_adapter, load_hf_weights

        load_hf_weights(ctx.state.model_parts, path, build_adapter(ctx.model.name, ctx.model_args), ctx.group)
    elif (path / COMMIT_FILE).is_file():  # as the initial load read it, partially where it was allowed to
        load_weights(ctx, path, partial=ctx.checkpoint.initial_load_partial)
    else:  # a base checkpoint from elsewhere
        load_weights(ctx, path, family_spellings(ctx.model.name, ctx.model_args), ctx.checkpoint.initial_load_writer,
                     partial=ctx.checkpoint.initial_load_partial)
    logger.info(f"checkpoint: frozen base weights of {plan.path.name} loaded from {path}")


def start_lora(ctx: RunContext, plan: Plan) -> None:
    """After a LoRA run's resume or initial load: set the base its checkpoints refer to (the loaded checkpoint's, or
    the checkpoint just loaded), and load lora.initial_adapter_path's adapters on an initial load."""
    if ctx.lora is None or not ctx.lora.enable:
        return
    if plan.rule == "resume":
        ctx.base = plan.lora_base
        return
    ctx.base = plan.lora_base or base_reference(plan.path, in_hf=plan.source == "hf")
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
