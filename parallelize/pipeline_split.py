"""Cutting a decoder into the pipeline stages one rank runs: copies of the model with the other parts removed.

A stage is the model itself minus what it does not own (the decoder protocol, ``dtrain.models.decoder``): blocks are
deleted from the blocks' nn.ModuleDict (keyed by layer id, so the remaining blocks keep their names) and the
embedding, final norm and head are set to None. Every parameter therefore keeps its full-model name (``layers.5.attention.wq.weight`` stays that on
whichever stage holds block 5), so the union of the stages' state dicts is the full model's state dict: DCP
checkpoints reshard between pipeline and non-pipeline layouts, and a single-device initialisation can be copied
into the stages name by name.

Cut the model while it is on the meta device (copying it is then free), then parallelize each stage, move it
with ``to_empty`` and initialise it, as for a whole model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from dtrain.models.decoder import decoder_layout
from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.pipeline_plan import PipelinePlan


@dataclass
class StageModule:
    """One pipeline stage of this rank: its index in the pipeline and its part of the model."""

    index: int
    module: nn.Module


def cut_stage(model: nn.Module, modules: tuple[str, ...]) -> nn.Module:
    """A copy of `model` holding only `modules` (full-model names from its decoder layout)."""
    decoder = decoder_layout(model)
    stage = copy.deepcopy(model)
    owned = set(modules)
    blocks = decoder.blocks_of(stage)
    for name in list(blocks.keys()):
        if decoder.block(int(name)) not in owned:
            del blocks[name]
    for part in decoder.optional_parts:
        if part not in owned:
            setattr(stage, part, None)
    return stage


def split_model(model: nn.Module, plan: PipelinePlan, pp_rank: int) -> list[StageModule]:
    """The stages pipeline rank `pp_rank` runs, in increasing stage order, cut from `model` (left untouched)."""
    decoder = decoder_layout(model)
    layer_names = {decoder.block(int(name)) for name in decoder.blocks_of(model).keys()}
    planned = {name for names in plan.stage_modules for name in names if decoder.block_index(name) is not None}
    if layer_names != planned:
        raise ParallelismError(
            f"the pipeline plan covers {len(planned)} layers but the model has {len(layer_names)}; "
            "plan with the model's n_layers"
        )
    return [StageModule(index, cut_stage(model, plan.stage_modules[index])) for index in plan.stage_indices(pp_rank)]
