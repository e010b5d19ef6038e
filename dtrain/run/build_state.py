"""The TrainState of a run, built from its config: the model parts (meta -> parallelized -> materialized ->
initialised), optimizer, LR schedule, data and the step executor of the layout."""

from __future__ import annotations

import logging

import torch

from dtrain.config.schema import JobConfig
from dtrain.data import build_dataloader
from dtrain.models import ModelFamily, count_params
from dtrain.observe.compile_report import watch_graph_breaks
from dtrain.parallelize import FamilySpec, compile_kwargs
from dtrain.precision.float8 import build_float8_training
from dtrain.precision.mx import build_mx_training
from dtrain.run.layout import ParallelLayout
from dtrain.run.memory_preflight import Workload
from dtrain.run.model_builder import build_model_parts
from dtrain.run.world import World
from dtrain.step.executor import build_step_executor
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import TrainState
from dtrain.step.train_step import cross_entropy_sum

logger = logging.getLogger("dtrain")


def build_train_state(
    cfg: JobConfig, world: World, layout: ParallelLayout, family: FamilySpec, args, tokenizer
) -> TrainState:
    """Model parts (meta → parallelized → materialized → initialised), optimizer, schedule, data and the executor
    of this layout, as one state."""
    # At most one low-precision converter (the config refuses float8 with mx).
    converter = build_float8_training(cfg, layout.dims.fsdp_enabled, world.device) or build_mx_training(cfg)
    stages = build_model_parts(
        family, args, layout, world.device, seed=cfg.debug.seed, workload=Workload.of(cfg, layout),
        convert=converter.convert if converter else None,
    )
    model_parts = [stage.module for stage in stages]
    optimizer = build_optimizers(model_parts, cfg.optimizer, world.device)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_scheduler)
    rank = layout.rank
    dataloader = build_dataloader(cfg.training, tokenizer, rank.dp_rank, rank.dp_size, seed=cfg.debug.seed)
    logger.info(f"data: {dataloader.description}")
    loss_fn = cross_entropy_sum
    if cfg.compile.enable:
        watch_graph_breaks()  # compiling is lazy: the breaks happen in the first step, reported after it
        if "loss" in cfg.compile.components:
            c = cfg.compile
            loss_fn = torch.compile(loss_fn, **compile_kwargs(c.backend, c.mode, c.fullgraph, c.dynamic))
    return TrainState(
        model_parts=model_parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataloader=dataloader,
        executor=build_step_executor(
            family, layout, stages, loss_fn, world.device, converter.optimizer_step_hook if converter else None
        ),
        seed=cfg.debug.seed,
        max_norm=cfg.training.max_norm,
        skip_nonfinite_steps=cfg.training.skip_nonfinite_steps,
        rank=rank,
    )


def whole_model_params(family: ModelFamily, args) -> int:
    """Parameters of the whole model, whatever part of it this rank holds (built on meta: free)."""
    with torch.device("meta"):
        return count_params(family.model_cls(args))
