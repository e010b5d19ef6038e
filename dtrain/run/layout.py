"""The parallel layout of a run, as data: degrees, parallelize options, pipeline plan, mesh and this rank's place.

It is built from the config sections that describe it, and `check_layout` refuses an impossible one before any
process group exists. What is done with a layout lives elsewhere, each job under its own name:
`model_builder.build_model_parts` (this rank's model, parallelized and initialised),
`build_state.build_step_executor` (how the step runs forward and backward on it) and `layout_report` (what the log
says about it).

The same path serves one process and many: a single process is a world of one whose "parallelization" is
activation checkpointing and compile only (no mesh), so every config key means the same thing everywhere.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from dtrain.config.converters import check_mx_compute_dtype
from dtrain.config.schema import JobConfig, Parallelism, Validation
from dtrain.errors import ConfigError
from dtrain.models.decoder import DecoderArgs
from dtrain.parallelize import (
    FamilySpec,
    ParallelDims,
    ParallelismError,
    ParallelizeOptions,
    build_mesh,
    check_compile_options,
)
from dtrain.parallelize.context_parallel import shard_sequence
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.pipeline_plan import PipelinePlan, plan_pipeline
from dtrain.run.world import World, dp_rank_and_size, dp_summer
from dtrain.step.state import RankCoordinates


@dataclass(frozen=True)
class ParallelLayout:
    """How this run is laid out over the ranks, and where this rank sits in it (mesh None: one process)."""

    dims: ParallelDims
    options: ParallelizeOptions
    mesh: ParallelMesh | None = None
    plan: PipelinePlan | None = None
    rank: RankCoordinates = field(default_factory=RankCoordinates)


def parallel_dims(parallelism: Parallelism, world_size: int) -> ParallelDims:
    p = parallelism
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
    """The options of five config sections (training, parallelism, activation_checkpoint, compile, job): reads
    the whole config, as it assembles them."""
    trace = cfg.compile.trace_folder
    return ParallelizeOptions(
        device_type=device_type,
        param_dtype=cfg.training.mixed_precision_param,
        reduce_dtype=cfg.training.mixed_precision_reduce,
        reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
        cpu_offload=cfg.training.enable_cpu_offload,
        ac_mode=cfg.activation_checkpoint.mode,
        selective_ac_option=cfg.activation_checkpoint.selective_ac_option,
        memory_budget=cfg.activation_checkpoint.memory_budget,
        compile_model=cfg.compile.enable and "model" in cfg.compile.components,
        compile_backend=cfg.compile.backend,
        compile_mode=cfg.compile.mode,
        compile_fullgraph=cfg.compile.fullgraph,
        compile_dynamic=cfg.compile.dynamic,
        compile_granularity=cfg.compile.granularity,
        compile_trace_dir=os.path.join(cfg.job.dump_folder, trace) if cfg.compile.enable and trace else None,
        async_tp=cfg.parallelism.enable_async_tensor_parallel,
        cp_load_balancer=cfg.parallelism.context_parallel_load_balancer,
        cp_rotate_method=cfg.parallelism.context_parallel_rotate_method,
        attention_mask=cfg.training.attention_mask,
        attention_mask_backend=cfg.training.attention_mask_backend,
    )


def pipeline_plan(
    parallelism: Parallelism, local_batch_size: int, dims: ParallelDims, family: FamilySpec, model_args: DecoderArgs
) -> PipelinePlan | None:
    """The stages and schedule of a pipeline-parallel run (None without PP); validates the pipeline keys."""
    if dims.pp == 1:
        return None
    p = parallelism
    return plan_pipeline(
        pp=dims.pp,
        schedule=p.pipeline_parallel_schedule,
        decoder=family.model.model_cls.decoder_layout,
        n_layers=model_args.n_layers,
        local_batch_size=local_batch_size,
        microbatch_size=p.pipeline_parallel_microbatch_size,
        layers_per_stage=p.pipeline_parallel_layers_per_stage,
        stage_modules=p.module_fqns_per_model_part or None,
        tie_word_embeddings=model_args.tie_word_embeddings,
        fsdp_reshard_after_forward=p.fsdp_reshard_after_forward,
        ddp=dims.ddp_enabled,
    )


def check_layout(cfg: JobConfig, world_size: int, family: FamilySpec, model_args: DecoderArgs) -> None:
    """Refuse a layout that cannot run, before any process group exists; reads the whole config: it is the
    pre-flight over every section a layout depends on."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    training = cfg.training
    try:
        dims = parallel_dims(cfg.parallelism, world_size)
        plan = pipeline_plan(cfg.parallelism, training.local_batch_size, dims, family, model_args)
        family.check_shapes(dims, model_args, training.seq_len)
        options = parallelize_options(cfg, device_type)
        torch_ring = options.cp_attention_path == "ring"
        dims.check_cp_divides(training.seq_len, cfg.parallelism.context_parallel_load_balancer, torch_ring)
        family.check_hooks(plan, model_args)
        dims.gradient_accumulation_steps(training.local_batch_size, training.global_batch_size)
        options.validate(dims)
        if cfg.compile.enable:  # also when only the loss is compiled
            c = cfg.compile
            check_compile_options(
                c.mode, c.dynamic, c.granularity, c.backend, device_type, fullgraph=c.fullgraph,
                data_parallel=(dims.fsdp_enabled or dims.ddp_enabled) and "model" in c.components,
            )
        check_mx_compute_dtype(cfg, dims.fsdp_enabled)
    except ParallelismError as err:
        raise ConfigError(str(err)) from None
    if cfg.validation.enable:
        check_validation_layout(cfg.validation, cfg.parallelism, dims, family, model_args, torch_ring)


def check_validation_layout(
    v: Validation,
    parallelism: Parallelism,
    dims: ParallelDims,
    family: FamilySpec,
    model_args: DecoderArgs,
    torch_ring: bool = False,
) -> None:
    """Validation batches split over the ranks as training's do: the sequence over TP and CP ranks, the batch
    into pipeline microbatches. The checks are training's, so their messages are told which keys gave the sizes."""
    try:
        family.check_shapes(dims, model_args, v.seq_len)
        dims.check_cp_divides(v.seq_len, parallelism.context_parallel_load_balancer, torch_ring)
        pipeline_plan(parallelism, v.local_batch_size, dims, family, model_args)
    except ParallelismError as err:
        message = str(err).replace("training.seq_len", "validation.seq_len")
        raise ConfigError(message.replace("training.local_batch_size", "validation.local_batch_size")) from None


def rank_coordinates(mesh: ParallelMesh | None, cp_load_balancer: str = "headtail") -> RankCoordinates:
    """This rank's coordinates on `mesh` (None: the one process of a world of one)."""
    if mesh is None:
        return RankCoordinates()
    dp_rank, dp_size = dp_rank_and_size(mesh)
    cp_rank, cp_size = mesh["cp"].get_local_rank(), mesh["cp"].size()
    return RankCoordinates(
        pp_rank=mesh["pp"].get_local_rank(),
        dp_rank=dp_rank,
        dp_size=dp_size,
        rng_coords=("dp", dp_rank),
        reduce_over_dp=dp_summer(mesh),
        cp_size=cp_size,
        shard_sequence=(
            functools.partial(shard_sequence, cp_rank=cp_rank, cp=cp_size, load_balancer=cp_load_balancer)
            if cp_size > 1 else None
        ),
    )


def build_layout(cfg: JobConfig, world: World, family: FamilySpec, model_args: DecoderArgs) -> ParallelLayout:
    """The layout of this world: mesh, pipeline plan and this rank's coordinates (after the process group); reads
    the whole config: it assembles the layout."""
    dims = parallel_dims(cfg.parallelism, world.world_size)
    options = parallelize_options(cfg, world.device.type)
    if not world.distributed:
        return ParallelLayout(dims, options)
    mesh = build_mesh(dims, world.device.type)
    plan = pipeline_plan(cfg.parallelism, cfg.training.local_batch_size, dims, family, model_args)
    return ParallelLayout(dims, options, mesh=mesh, plan=plan, rank=rank_coordinates(mesh, options.cp_load_balancer))

