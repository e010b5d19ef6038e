"""The TrainState of a run, built from its config: the model parts (meta -> parallelized -> materialized ->
initialised), optimizer, LR schedule, data, and the step's setup with the executor of the layout."""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dtrain.config.schema import JobConfig, LoRA
from dtrain.data import build_dataloader
from dtrain.fault_tolerance.data_share import data_slot, job_rank_coordinates
from dtrain.models import ModelFamily, count_params
from dtrain.observe.compile_report import watch_graph_breaks
from dtrain.parallelize import FamilySpec, compile_kwargs
from dtrain.parallelize.family_spec import OptimizerStepHook
from dtrain.parallelize.pipeline_extra_loss import StageExtraLoss
from dtrain.parallelize.pipeline_schedule import build_pipeline
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.precision.float8 import build_float8_training
from dtrain.precision.lora import LoRATraining
from dtrain.precision.mx import build_mx_training
from dtrain.run.layout import ParallelLayout
from dtrain.run.memory_preflight import Workload
from dtrain.run.model_builder import build_model_parts
from dtrain.run.validation import held_out_fraction
from dtrain.run.world import World
from dtrain.step.executor import LocalExecutor, PipelineExecutor, StepExecutor
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.train_step import StepLoss

logger = logging.getLogger("dtrain")
# A run's own loss in place of the token cross-entropy (the preference losses: dtrain/preference/build.py), built
# from (cfg, layout, family, model args, this rank's stages, device, workload).
LossBuilder = Callable[..., StepLoss]


def build_train_state(
    cfg: JobConfig, world: World, layout: ParallelLayout, family: FamilySpec, args, tokenizer,
    build_loss: LossBuilder | None = None,
) -> TrainState:
    """Model parts (meta → parallelized → materialized → initialised), optimizer, schedule, data and the executor
    of this layout, as one state; reads the whole config: it assembles the state from each section's part.
    `build_loss` builds the run's loss when it is not the token cross-entropy."""
    # At most one low-precision converter (the config refuses float8 with mx).
    converters, linear = cfg.model.converters, cfg.quantize.linear
    converter = build_float8_training(
        converters, linear.float8, cfg.parallelism.tensor_parallel_degree, layout.dims.fsdp_enabled, world.device
    ) or build_mx_training(converters, linear.mx)
    # LoRA refuses low-precision converters (config check), so at most one of them transforms the model.
    lora = build_lora_training(cfg.lora, layout)
    transform = lora or converter
    quantize_base = cfg.lora.enable and cfg.lora.quantize_base
    workload = Workload.of(cfg.training, cfg.optimizer, layout, quantize_base=quantize_base)
    stages = build_model_parts(
        family, args, layout, world.device, seed=cfg.debug.seed, workload=workload,
        convert=transform.convert if transform else None,
    )
    model_parts = [stage.module for stage in stages]
    if lora is not None:
        for part in model_parts:
            lora.init(part, cfg.debug.seed)
    optimizer = build_optimizers(model_parts, cfg.optimizer, world.device)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_scheduler)
    rank = job_rank_coordinates(layout.rank, cfg.fault_tolerance)
    dataloader = build_dataloader(
        cfg.training, tokenizer, *data_slot(rank, cfg.fault_tolerance), seed=cfg.debug.seed,
        held_out=held_out_fraction(cfg.training, cfg.validation),  # the chat rows validation holds out, if any
    )
    logger.info(f"data: {dataloader.description}")
    c = cfg.compile
    if c.enable:
        watch_graph_breaks()  # compiling is lazy: the breaks happen in the first step, reported after it
    compile_loss = c.enable and "loss" in c.components
    if build_loss is not None:
        loss = build_loss(cfg, layout, family, args, stages, world.device, workload)
    else:
        loss = StepLoss.build(
            layout.dims, compile_kwargs(c.backend, c.mode, c.fullgraph, c.dynamic) if compile_loss else None,
            source_names=dataloader.source_names,  # a mixture's sources: their loss and tokens are logged apart
        )
    executor = build_step_executor(
        family, layout, stages, loss, world.device, converter.optimizer_step_hook if converter else None
    )
    setup = StepSetup(
        executor=executor,
        seed=cfg.debug.seed,
        max_norm=cfg.training.max_norm,
        skip_nonfinite_steps=cfg.training.skip_nonfinite_steps,
        rank=rank,
    )
    return TrainState(
        model_parts=model_parts, optimizer=optimizer, lr_scheduler=lr_scheduler, dataloader=dataloader, setup=setup
    )


def build_lora_training(lora: LoRA, layout: ParallelLayout) -> LoRATraining | None:
    """The run's LoRA transform, with NF4 base weights under lora.quantize_base (quantized after the start-up's
    load: checkpoint/restore.py)."""
    if not lora.enable:
        return None
    if not lora.quantize_base:
        return LoRATraining(lora)
    from dtrain.precision.qlora import QLoRATraining  # torchao is imported only for QLoRA

    return QLoRATraining(lora, shards=layout.dims.dp_shard if layout.dims.fsdp_enabled else 1)


def build_step_executor(
    family: FamilySpec,
    layout: ParallelLayout,
    stages: list[StageModule],
    loss: StepLoss,
    device: torch.device,
    after_optimizer_step: OptimizerStepHook | None = None,
) -> StepExecutor:
    """The executor of `layout`: the pipeline schedule over `stages` under pipeline parallelism, else local.

    `after_optimizer_step` (e.g. float8's scale precompute) runs after the family's own hook.
    """
    common = dict(
        optimizer_step_hook=chain_hooks(family.after_optimizer_step, after_optimizer_step),
        metrics_hook=family.step_metrics,
    )
    parts = [stage.module for stage in stages]
    terms = family.extra_loss_terms(parts) if family.extra_loss is not None else 0
    if layout.plan is None:
        return LocalExecutor(loss, extra_loss=family.extra_loss, extra_loss_terms=terms, **common)
    pp_group = layout.mesh["pp"].get_group()
    if family.extra_loss is not None:
        terms = terms_of_all_stages(terms, pp_group, device)
    extra_loss = StageExtraLoss(family.extra_loss, stages, terms, layout.plan.num_stages) if terms else None
    pipeline = build_pipeline(
        layout.plan, stages, pp_group=pp_group, device=device, loss_fn=loss, extra_loss=extra_loss
    )
    return PipelineExecutor(loss, pipeline=pipeline, extra_loss_terms=terms, **common)


def terms_of_all_stages(terms: int, pp_group: dist.ProcessGroup, device: torch.device) -> int:
    """The number of extra loss terms of the whole model: this rank's stages hold `terms` (summed over the
    pipeline ranks, once, as the executor is built)."""
    total = torch.tensor(terms, device=device)
    dist.all_reduce(total, group=pp_group)
    return int(total.item())


def chain_hooks(*hooks: OptimizerStepHook | None) -> OptimizerStepHook | None:
    """One hook that runs the given ones in order, or None when none is given."""
    present = [hook for hook in hooks if hook is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def run_all(model_parts: list[nn.Module]) -> None:
        for hook in present:
            hook(model_parts)

    return run_all


def whole_model_params(family: ModelFamily, args) -> int:
    """Parameters of the whole model, whatever part of it this rank holds (built on meta: free)."""
    with torch.device("meta"):
        return count_params(family.model_cls(args))
