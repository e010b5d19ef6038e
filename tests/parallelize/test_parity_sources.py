"""A dataset mixture's loss and tokens by source on 2 ranks, one world for all layouts: FSDP2 with gradient
accumulation, TP with vocab-parallel loss, context parallel, and pipelines whose loss is computed on the last stage
inside the schedule (1F1B: on rank 1; ZBVZeroBubble, two stages per rank: on rank 0) report every source's loss
and tokens as one process does, and on each layout the sources' tokens add up to the step's and their
token-weighted mean loss is the step's loss (fp32, 1e-5)."""

from __future__ import annotations

import math

import pytest
import torch
from dist_harness import run_world
from parity_layouts import (
    SEED,
    NoData,
    build_parallel_model,
    family_spec,
    global_batch,
    mesh_for,
    microbatches,
    whole_model,
)
from test_pipeline_parity import PIPELINE_ARGS, PipelineLayout, pipelined_state

from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.parallelize import ParallelDims, ParallelizeOptions
from dtrain.run.build_state import build_step_executor
from dtrain.run.layout import ParallelLayout, rank_coordinates
from dtrain.run.world import dp_rank_and_size
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.source_loss import SOURCE_IDS
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.train_step import StepLoss, train_step

pytestmark = pytest.mark.multiprocess

ARGS = PIPELINE_ARGS["llama3"]  # 4 blocks, so that the pipeline has a block in each stage
NAMES = ("web", "code", "books")
STEPS = 4
CPU = torch.device("cpu")
# name: parallel degrees on 2 ranks, microbatches per step and rank, pipeline schedule
LAYOUTS = {
    "fsdp_accumulate": (dict(dp_shard=2), 2, None),
    "tp_loss_parallel": (dict(dp_shard=1, tp=2), 1, None),
    "cp": (dict(dp_shard=1, cp=2), 1, None),
    "pp_1f1b": (dict(dp_shard=1, pp=2), 1, "1F1B"),
    "pp_zbv_zero_bubble": (dict(dp_shard=1, pp=2), 1, "ZBVZeroBubble"),
}


def with_sources(mbs: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each row's source follows from its first token (so every layout's slice of the global batch agrees)."""
    return [{**mb, SOURCE_IDS: (mb["input_ids"][:, :1] // 16 % 3).expand_as(mb["labels"]).contiguous()} for mb in mbs]


def mixture_state(stages, dims: ParallelDims, mesh=None, plan=None) -> TrainState:
    """The trainer's state for these stages, its step executor built with a mixture's loss."""
    options = ParallelizeOptions()
    rank = rank_coordinates(mesh, options.cp_load_balancer)
    layout = ParallelLayout(dims, options, mesh, plan, rank)
    parts = [stage.module for stage in stages]
    optimizer = build_optimizers(parts, Optimizer(lr=1e-2), CPU)
    scheduler = build_lr_scheduler(optimizer, STEPS, LRScheduler(warmup_steps=2))
    executor = build_step_executor(family_spec("llama3"), layout, stages, StepLoss.build(dims, source_names=NAMES), CPU)
    return TrainState(parts, optimizer, scheduler, NoData(), StepSetup(executor, seed=SEED, max_norm=1.0, rank=rank))


def run(state: TrainState, mesh, accumulation: int) -> list[dict[str, float]]:
    dp_rank, dp_size = dp_rank_and_size(mesh)
    steps = []
    for step in range(STEPS):
        metrics = train_step(state, with_sources(microbatches(step, dp_rank, dp_size, accumulation)))
        steps.append({k: float(v) for k, v in metrics.items() if k == "loss" or "/" in k})
    return steps


def single_process() -> list[dict[str, float]]:
    with torch.device("meta"):
        model = family_spec("llama3").model.model_cls(ARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    return run(mixture_state(whole_model(model), ParallelDims(1)), None, accumulation=2)


def run_layouts(rank: int, world_size: int) -> dict:
    report = {"reference": single_process() if rank == 0 else None}
    meshes: dict = {}
    for name, (degrees, accumulation, schedule) in LAYOUTS.items():
        dims = ParallelDims(world_size, **degrees)
        mesh = mesh_for(dims, meshes)
        if schedule is not None:  # the stages and plan as the pipeline tests build them
            pipeline = pipelined_state(PipelineLayout(name, schedule), world_size, meshes)[0].setup.executor.pipeline
            state = mixture_state(pipeline.stages, dims, mesh, pipeline.plan)
        else:
            state = mixture_state(whole_model(build_parallel_model(ARGS, dims, mesh)), dims, mesh)
        report[name] = run(state, mesh, accumulation)
    return report


@pytest.fixture(scope="module")
def report():
    return run_world(2, run_layouts, timeout_s=180)


def same(value: float, expected: float) -> bool:
    """Equal within fp32 noise; a source absent from a step has a NaN loss on both sides."""
    return math.isclose(value, expected, rel_tol=1e-5) or (math.isnan(value) and math.isnan(expected))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_source_metrics_match_one_process_and_add_up_to_the_step(report, layout):
    for step, (got, expected) in enumerate(zip(report[layout], report["reference"], strict=True)):
        fields = ["loss", *(f"{kind}/{name}" for kind in ("loss", "tokens") for name in NAMES)]
        assert sorted(got) == sorted(expected) == sorted(fields)
        for key, value in expected.items():
            assert same(got[key], value), (layout, step, key, got[key], value)
        tokens = [got[f"tokens/{name}"] for name in NAMES]
        assert sum(tokens) == (global_batch(step)[1] != IGNORE_INDEX).sum().item()
        weighted = sum(got[f"loss/{name}"] * count for name, count in zip(NAMES, tokens) if count)
        assert math.isclose(weighted / sum(tokens), got["loss"], rel_tol=1e-5), (layout, step)
