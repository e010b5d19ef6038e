"""This rank's model parts, built the abstract-init way: meta device, parallelize, materialize, initialise.

No rank ever holds the whole model: it is built on the meta device (free), cut into this rank's pipeline stages
when there are any, parallelized, checked against the memory it will need (``memory_preflight``), moved to the
device with ``to_empty``, and only then given its values.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from dtrain.models.decoder import DecoderArgs
from dtrain.parallelize import FamilySpec, init_weights_like_single_device, init_weights_sharded
from dtrain.parallelize.pipeline_split import StageModule, split_model
from dtrain.run.layout import ParallelLayout
from dtrain.run.memory_preflight import Workload, check_memory
from dtrain.step.rng import derive_seed


def build_model_parts(
    family: FamilySpec,
    model_args: DecoderArgs,
    layout: ParallelLayout,
    device: torch.device,
    seed: int,
    workload: Workload,
    convert: Callable[[nn.Module], None] | None = None,
) -> list[StageModule]:
    """This rank's model parts, parallelized, on `device`, initialised and in train mode, each with its stage index.

    A `workload` whose estimated memory cannot fit is refused before anything is allocated on `device`. `convert`
    (e.g. float8 training) swaps modules of the whole model on the meta device, before it is split and parallelized.

    Under pipeline parallelism these are the rank's stages; otherwise the whole model, as the one stage (index 0)
    of a pipeline of one.
    """
    with torch.device("meta"):
        model = family.model.model_cls(model_args)
    if convert is not None:
        convert(model)
    # An unparallelized twin for the exact initialisation below; on the meta device it costs nothing.
    reference = copy.deepcopy(model)
    stages = split_model(model, layout.plan, layout.rank.pp_rank) if layout.plan else [StageModule(0, model)]
    stages = [
        StageModule(stage.index, family.parallelize(stage.module, layout.mesh, layout.dims, layout.options))
        for stage in stages
    ]
    # The parts are still on the meta device with their final local shapes: the last moment to refuse for free.
    check_memory([stage.module for stage in stages], model_args, layout, workload, device)
    for stage in stages:
        stage.module.to_empty(device=device)
        stage.module.train()
        init_weights(stage, reference, layout, seed)
    return stages


def init_weights(stage: StageModule, reference: nn.Module, layout: ParallelLayout, seed: int) -> None:
    """The single-process weights on every layout (exact), except on multi-GPU runs (scalable, see below)."""
    if layout.dims.world_size > 1 and layout.options.device_type == "cuda":
        # A full host copy per rank does not scale to 8B+ on 8 GPUs; DTensor's CUDA offset RNG gives each shard
        # its own slice of the stream instead (correct, not bit-identical to one GPU), seeded per stage so that
        # stages differ. A seed checkpoint gives exact equality across layouts at any size.
        init_weights_sharded(stage.module, derive_seed(seed, "init", stage.index))
    else:
        init_weights_like_single_device(stage.module, reference, derive_seed(seed, "init"))
