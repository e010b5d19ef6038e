"""The trainer's view of the parallel layout: config → parallelize calls, and what the step and loop need back.

The same path serves one process and many: a single process is a world of one whose "parallelization" is
activation checkpointing and compile only (no mesh), so every config key means the same thing everywhere.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from dtrain.config.schema import JobConfig
from dtrain.distributed import World
from dtrain.errors import ConfigError
from dtrain.parallelize import (
    FamilySpec,
    ParallelDims,
    ParallelismError,
    ParallelizeOptions,
    build_mesh,
    format_tp_plan,
    init_weights_like_single_device,
    init_weights_sharded,
    local_loss,
    loss_parallel_context,
    memory_footprint,
)
from dtrain.parallelize.pipeline_bubble import format_bubbles
from dtrain.parallelize.pipeline_plan import PipelinePlan, plan_pipeline
from dtrain.parallelize.pipeline_schedule import Pipeline, build_pipeline
from dtrain.parallelize.pipeline_split import StageModule, split_model
from dtrain.rng import derive_seed

logger = logging.getLogger("dtrain")


def parallel_dims(cfg: JobConfig, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    return ParallelDims(
        world_size,
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        cp=p.context_parallel_degree,
        ep=p.expert_parallel_degree,
        sequence_parallel=not p.disable_sequence_parallel,
        loss_parallel=not p.disable_loss_parallel,
    )


def parallelize_options(cfg: JobConfig, device_type: str) -> ParallelizeOptions:
    trace = cfg.compile.trace_folder
    return ParallelizeOptions(
        device_type=device_type,
        param_dtype=cfg.training.mixed_precision_param,
        reduce_dtype=cfg.training.mixed_precision_reduce,
        reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
        cpu_offload=cfg.training.enable_cpu_offload,
        ac_mode=cfg.activation_checkpoint.mode,
        selective_ac_option=cfg.activation_checkpoint.selective_ac_option,
        compile_model=cfg.compile.enable and "model" in cfg.compile.components,
        compile_backend=cfg.compile.backend,
        compile_trace_dir=os.path.join(cfg.job.dump_folder, trace) if cfg.compile.enable and trace else None,
        async_tp=cfg.parallelism.enable_async_tensor_parallel,
    )


def pipeline_plan(cfg: JobConfig, dims: ParallelDims, family: FamilySpec, model_args) -> PipelinePlan | None:
    """The stages and schedule of a pipeline-parallel run (None without PP); validates the pipeline keys."""
    if dims.pp == 1:
        return None
    p = cfg.parallelism
    return plan_pipeline(
        pp=dims.pp,
        schedule=p.pipeline_parallel_schedule,
        decoder=family.model.model_cls.decoder_layout,
        n_layers=model_args.n_layers,
        local_batch_size=cfg.training.local_batch_size,
        microbatch_size=p.pipeline_parallel_microbatch_size,
        layers_per_stage=p.pipeline_parallel_layers_per_stage,
        stage_modules=p.module_fqns_per_model_part or None,
        tie_word_embeddings=model_args.tie_word_embeddings,
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        ddp=dims.ddp_enabled,
    )


def check_layout(cfg: JobConfig, world_size: int, family: FamilySpec, model_args) -> None:
    """Refuse a layout that cannot run, before any process group exists."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dims = parallel_dims(cfg, world_size)
        pipeline_plan(cfg, dims, family, model_args)
        family.check_shapes(dims, model_args, cfg.training.seq_len)
        dims.gradient_accumulation_steps(cfg.training.local_batch_size, cfg.training.global_batch_size)
        parallelize_options(cfg, device_type).validate(dims)
    except ParallelismError as err:
        raise ConfigError(str(err)) from None


@dataclass
class Layout:
    """How this rank's model is laid out, and how the step reduces over the data-parallel ranks."""

    family: FamilySpec
    dims: ParallelDims
    options: ParallelizeOptions
    mesh: object = None
    plan: PipelinePlan | None = None
    pp_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    rng_coords: tuple = ()
    reduce_over_dp: Callable[[torch.Tensor], torch.Tensor] = field(default=lambda t: t)
    loss_context: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    _meta_reference: nn.Module | None = None
    _stages: list[StageModule] | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The matmul dtype (for the MFU peak): FSDP's mixed-precision param dtype, else float32."""
        return getattr(torch, self.options.param_dtype) if self.dims.fsdp_enabled else torch.float32

    def parallelize(self, model: nn.Module) -> list[nn.Module]:
        """This rank's model parts (its pipeline stages, else the whole model), each TP/AC/compile/FSDP'd.

        `model` is on the meta device and is consumed.
        """
        # An unparallelized twin for the exact initialisation below; on the meta device it costs nothing.
        self._meta_reference = copy.deepcopy(model)
        parallelize_fn = self.family.parallelize
        if self.plan is None:
            return [parallelize_fn(model, self.mesh, self.dims, self.options)]
        self._stages = split_model(model, self.plan, self.pp_rank)
        return [parallelize_fn(stage.module, self.mesh, self.dims, self.options) for stage in self._stages]

    def init_weights(self, model_parts: list[nn.Module], seed: int) -> None:
        """The single-process weights on every layout (exact), except on multi-GPU runs (scalable, see below)."""
        stage_indices = [stage.index for stage in self._stages] if self._stages else [0]
        for index, part in zip(stage_indices, model_parts):
            if self.dims.world_size > 1 and self.options.device_type == "cuda":
                # A full host copy per rank does not scale to 8B+ on 8 GPUs; DTensor's CUDA offset RNG gives each
                # shard its own slice of the stream instead (correct, not bit-identical to one GPU), seeded per
                # stage so that stages differ. A seed checkpoint gives exact equality across layouts at any size.
                init_weights_sharded(part, derive_seed(seed, "init", index))
            else:
                init_weights_like_single_device(part, self._meta_reference, derive_seed(seed, "init"))
        self._meta_reference = None

    def wrap_loss(self, loss_fn: Callable) -> Callable:
        """The loss as a plain tensor also under loss parallel (where cross-entropy returns a DTensor)."""
        return local_loss(loss_fn) if self.dims.loss_parallel_enabled else loss_fn

    def build_pipeline(self, loss_fn: Callable, device: torch.device) -> Pipeline | None:
        """The schedule over this rank's materialized stages (None without pipeline parallelism)."""
        if self.plan is None:
            return None
        return build_pipeline(self.plan, self._stages, pp_group=self.mesh["pp"].get_group(), device=device, loss_fn=loss_fn)

    def local_metrics(self, metrics: dict) -> dict:
        """Step metrics as plain tensors for the logger (a DTensor grad norm is made whole here)."""
        from torch.distributed.tensor import DTensor

        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in metrics.items()}

    def describe(self) -> str:
        d = self.dims
        if d.world_size == 1:
            return "1 process"
        kinds = [
            name
            for name, on in (
                (f"PP {self.plan.schedule}" if self.plan else "PP", d.pp > 1),
                ("HSDP", d.hsdp_enabled),
                ("FSDP", d.fsdp_enabled and not d.hsdp_enabled),
                ("DDP", d.ddp_enabled),
                ("TP+SP" if d.sequence_parallel_enabled else "TP", d.tp_enabled),
            )
            if on
        ]
        return (
            f"{d.world_size} processes ({' + '.join(kinds)}: pp {d.pp} × dp_replicate {d.dp_replicate}"
            f" × dp_shard {d.dp_shard} × tp {d.tp})"
        )

    def log_plan(self) -> None:
        """The tensor-parallel plan and the pipeline split, so that a run's log says how the model is laid out."""
        if self.dims.tp_enabled:
            plan = self.family.tp_plan(
                sequence_parallel=self.dims.sequence_parallel_enabled, loss_parallel=self.dims.loss_parallel_enabled
            )
            logger.info("tensor-parallel plan:\n%s", format_tp_plan(plan))
        if self.plan is not None:
            logger.info(self.plan.describe())
            logger.info(format_bubbles(self.plan))

    def log_memory(self, model_parts: list[nn.Module], optimizer) -> None:
        footprints = [memory_footprint(part, opt) for part, opt in zip(model_parts, optimizer.optimizers)]
        logger.info("memory on this rank: %s", sum(footprints[1:], footprints[0]).format())


def build_layout(cfg: JobConfig, world: World, family: FamilySpec, model_args) -> Layout:
    """The layout of this world: mesh, data-parallel coordinates and reductions (after the process group)."""
    from dtrain.distributed import dp_rank_and_size, dp_summer

    dims = parallel_dims(cfg, world.world_size)
    options = parallelize_options(cfg, world.device.type)
    if not world.distributed:
        return Layout(family, dims, options)
    mesh = build_mesh(dims, world.device.type)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    return Layout(
        family,
        dims,
        options,
        mesh=mesh,
        plan=pipeline_plan(cfg, dims, family, model_args),
        pp_rank=mesh["pp"].get_local_rank(),
        dp_rank=dp_rank,
        dp_size=dp_size,
        rng_coords=("dp", dp_rank),
        reduce_over_dp=dp_summer(mesh),
        loss_context=functools.partial(loss_parallel_context, dims),
    )
