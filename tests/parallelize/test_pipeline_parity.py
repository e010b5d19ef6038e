"""Pipeline parallel parity: every schedule trains like one process (2 ranks, pp=2, one world for all).

Each layout: plan, cut the meta model into this rank's stages, parallelize each stage (in the 4-rank tests),
materialize, initialise like one device, then STEPS steps of `pipelined_train_step` (the trainer's step with the
pipeline in place of forward/backward) on the same global batches as the single-process reference. The helpers
here are shared with test_pipeline_fsdp_tp.py (pp × FSDP2 and pp × TP on 4 ranks).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dist_harness import run_world
from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.distributed import dp_rank_and_size, dp_summer
from dtrain.lr_schedule import build_lr_scheduler
from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.optim import build_optimizer
from dtrain.parallelize import (
    ParallelDims,
    ParallelizeOptions,
    init_weights_like_single_device,
    local_loss,
    loss_parallel_context,
    model_fqn,
    parallelize_llama,
)
from dtrain.parallelize import pipeline_schedule
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.pipeline_plan import plan_pipeline
from dtrain.parallelize.pipeline_schedule import build_pipeline
from dtrain.parallelize.pipeline_split import split_model
from dtrain.rng import seed_everything
from dtrain.state import TrainState
from dtrain.step import IGNORE_INDEX, cross_entropy_sum, train_step

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ARGS = Llama3Args(
    dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, ffn_dim_multiplier=None, max_seq_len=16
)
STEPS = 10
GLOBAL_BATCH = 8
SEQ_LEN = 16
SEED = 1234
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class PipelineLayout:
    """One pipelined layout: schedule and degrees; `resharding_guard=False` skips the zero-bubble FSDP guard."""

    name: str
    schedule: str
    dp_shard: int = 1
    tp: int = 1
    microbatch_size: int = 2
    accumulation: int = 1
    layers_per_stage: int | None = None
    resharding_guard: bool = True
    steps: int = STEPS


SCHEDULES_2_RANKS = [
    PipelineLayout("gpipe", "GPipe"),
    PipelineLayout("1f1b", "1F1B"),
    PipelineLayout("1f1b_accumulate", "1F1B", microbatch_size=1, accumulation=2),
    PipelineLayout("interleaved_1f1b", "Interleaved1F1B"),
    PipelineLayout("interleaved_1f1b_3_per_rank", "Interleaved1F1B", layers_per_stage=1),
    PipelineLayout("looped_bfs", "LoopedBFS"),
    PipelineLayout("interleaved_zero_bubble", "InterleavedZeroBubble"),
    PipelineLayout("zbv_zero_bubble", "ZBVZeroBubble"),
    PipelineLayout("dualpipev", "DualPipeV", microbatch_size=1),
]
class NoData:
    """TrainState wants a Stateful dataloader; batches are fed directly here."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    labels = tokens[:, 1:].clone()
    labels[step % GLOBAL_BATCH, : 3 + step % 4] = IGNORE_INDEX  # uneven valid-token counts across ranks
    return tokens[:, :-1], labels


def microbatches(step: int, dp_rank: int, dp_size: int, count: int) -> list[dict[str, torch.Tensor]]:
    """This dp rank's `count` microbatches of the global batch: microbatch m is row block m * dp_size + dp_rank."""
    inputs, labels = global_batch(step)
    size = GLOBAL_BATCH // (dp_size * count)
    blocks = [m * dp_size + dp_rank for m in range(count)]
    return [{"input_ids": inputs[b * size : (b + 1) * size], "labels": labels[b * size : (b + 1) * size]} for b in blocks]


def plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def pipelined_train_step(state: TrainState, pipeline, microbatches: list[dict[str, torch.Tensor]]) -> dict:
    """dtrain.step.train_step with the pipeline running forward and backward and clipping over all stages."""
    seed_everything(state.seed, "step", state.step, *state.rng_coords)
    local_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in microbatches)
    global_tokens = state.reduce_over_dp(local_tokens)
    grad_scale = state.dp_size / global_tokens
    loss_sum = torch.zeros((), device=global_tokens.device)
    for mb in microbatches:
        with state.loss_context():
            loss_sum += pipeline.step(mb["input_ids"], mb["labels"], grad_scale)
    grad_norm = pipeline.clip_grad_norm(state.parameters, state.max_norm)
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    lr = state.lr_scheduler.get_last_lr()[0]
    state.lr_scheduler.step()
    state.step += 1
    state.tokens_seen += sum(mb["input_ids"].numel() for mb in microbatches) * state.dp_size
    return {"loss": state.reduce_over_dp(loss_sum) / global_tokens, "grad_norm": grad_norm, "lr": lr}


def new_state(parts, dp_size: int = 1, reduce_over_dp=lambda t: t, loss_context=contextlib.nullcontext,
              optimizer: torch.optim.Optimizer | None = None) -> TrainState:
    """A TrainState over `parts` with the test's optimizer (one over all parts unless given) and LR schedule."""
    if optimizer is None:
        optimizer = build_optimizer(parts, Optimizer(lr=1e-2), torch.device("cpu"))
    scheduler = build_lr_scheduler(optimizer, STEPS, LRScheduler(warmup_steps=2))
    return TrainState(
        parts, optimizer, scheduler, NoData(), local_loss(cross_entropy_sum), seed=SEED, max_norm=1.0,
        dp_size=dp_size, reduce_over_dp=reduce_over_dp, loss_context=loss_context,
    )


def train(state: TrainState, pipeline, steps: range, mesh: ParallelMesh | None, accumulation: int = 1) -> dict:
    """Losses and gradient norms (floats) of `steps`: the pipelined step with a pipeline, else the real one."""
    dp_rank, dp_size = dp_rank_and_size(mesh)
    losses, norms, rates = [], [], []
    for step in steps:
        batch = microbatches(step, dp_rank, dp_size, accumulation)
        metrics = train_step(state, batch) if pipeline is None else pipelined_train_step(state, pipeline, batch)
        losses.append(plain(metrics["loss"]).item())
        norms.append(plain(metrics["grad_norm"]).item())
        rates.append(float(metrics["lr"]))
    return {"losses": losses, "grad_norms": norms, "lrs": rates}


def single_process_run() -> dict:
    """The baseline: the plain single-device recipe and the real train_step on the whole global batch."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {**train(new_state([model]), None, range(STEPS), None), "initial": initial}


def world_mesh(world_size: int, layout: PipelineLayout, meshes: dict) -> ParallelMesh:
    """The (pp, dp_replicate, dp_shard, tp) mesh and its flattened dp view, built once per shape."""
    shape = (world_size // (layout.dp_shard * layout.tp), 1, layout.dp_shard, layout.tp)
    if shape not in meshes:
        world = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        meshes[shape] = ParallelMesh(world=world, dp=world["dp_replicate", "dp_shard"]._flatten("dp"))
    return meshes[shape]


@contextlib.contextmanager
def without_resharding_guard():
    """build_pipeline as it would be without keep_parameters_gathered (to show the trap it guards against)."""
    saved = pipeline_schedule.keep_parameters_gathered
    pipeline_schedule.keep_parameters_gathered = lambda stages: None
    try:
        yield
    finally:
        pipeline_schedule.keep_parameters_gathered = saved


def build_pipelined(layout: PipelineLayout, world_size: int, meshes: dict):
    """This rank's pipeline for `layout`, parallelized per stage and initialised like one device; and its mesh."""
    mesh = world_mesh(world_size, layout, meshes)
    pp_mesh = mesh["pp"]
    _, dp_size = dp_rank_and_size(mesh)
    plan = plan_pipeline(
        pp=pp_mesh.size(), schedule=layout.schedule, n_layers=ARGS.n_layers,
        local_batch_size=GLOBAL_BATCH // (dp_size * layout.accumulation), microbatch_size=layout.microbatch_size,
        layers_per_stage=layout.layers_per_stage,
    )
    with torch.device("meta"):
        model = Transformer(ARGS)
    stages = split_model(model, plan, pp_mesh.get_local_rank())
    # ParallelDims refuses pp > 1 until the trainer wires pipelining; each stage sees the dp × tp part.
    dims = ParallelDims(layout.dp_shard * layout.tp, dp_shard=layout.dp_shard, tp=layout.tp)
    for stage in stages:
        if dims.world_size > 1:
            parallelize_llama(stage.module, mesh, dims, ParallelizeOptions())
        stage.module.to_empty(device="cpu")
        init_weights_like_single_device(stage.module, model, SEED)
    guard = contextlib.nullcontext() if layout.resharding_guard else without_resharding_guard()
    with guard:
        pipeline = build_pipeline(
            plan, stages, pp_group=pp_mesh.get_group(), device=torch.device("cpu"), loss_fn=local_loss(cross_entropy_sum)
        )
    return pipeline, mesh, lambda: loss_parallel_context(dims)


def run_pipeline_layout(layout: PipelineLayout, world_size: int, meshes: dict) -> dict:
    pipeline, mesh, loss_context = build_pipelined(layout, world_size, meshes)
    # Every rank's stage weights, whole, by name: together they must be the single-process init.
    local_initial = {model_fqn(n): plain(p.detach()).clone() for part in pipeline.model_parts for n, p in part.named_parameters()}
    initial_per_rank = [None] * world_size
    torch.distributed.all_gather_object(initial_per_rank, local_initial)
    state = new_state(pipeline.model_parts, mesh["dp"].size(), dp_summer(mesh), loss_context)
    result = train(state, pipeline, range(layout.steps), mesh, layout.accumulation)
    initial = {name: tensor for rank_initial in initial_per_rank for name, tensor in rank_initial.items()}
    return {**result, "plan": pipeline.plan, "initial": initial}


def run_layouts(rank: int, world_size: int, layouts: list[PipelineLayout]) -> dict:
    """Rank 0's report: the reference run and, per layout, every pp rank's losses (they must agree)."""
    report = {"reference": single_process_run()}
    meshes: dict = {}
    for layout in layouts:
        start = time.perf_counter()
        result = run_pipeline_layout(layout, world_size, meshes)
        result["seconds"] = time.perf_counter() - start
        all_losses = [None] * world_size
        torch.distributed.all_gather_object(all_losses, result["losses"])
        result["losses_per_rank"] = all_losses
        report[layout.name] = result
    return report


def max_relative_diff(values: list[float], expected: list[float]) -> float:
    """Over the common prefix: a shorter run is compared with the start of a longer one."""
    return max(abs(v - e) / abs(e) for v, e in zip(values, expected))


@pytest.fixture(scope="module")
def report_2_ranks():
    return run_world(2, run_layouts, SCHEDULES_2_RANKS, timeout_s=240)


def assert_matches_single_process(report: dict, name: str) -> None:
    result, reference = report[name], report["reference"]
    assert sorted(result["initial"]) == sorted(reference["initial"])  # stages keep the full-model names
    assert max((result["initial"][k] - v).abs().max().item() for k, v in reference["initial"].items()) == 0.0
    assert len(result["losses"]) == STEPS
    assert max_relative_diff(result["losses"], reference["losses"][:STEPS]) <= LOSS_RTOL, name
    assert max_relative_diff(result["grad_norms"], reference["grad_norms"]) <= 10 * LOSS_RTOL, name
    assert result["losses"][-1] < result["losses"][0]
    # The loss is computed on the last stage's rank; every rank logs the same value.
    assert all(losses == result["losses"] for losses in result["losses_per_rank"])


@pytest.mark.parametrize("layout", SCHEDULES_2_RANKS, ids=lambda layout: layout.name)
def test_schedule_matches_single_process(report_2_ranks, layout):
    assert_matches_single_process(report_2_ranks, layout.name)


def test_schedules_ran_the_planned_stages(report_2_ranks):
    plans = {name: result["plan"] for name, result in report_2_ranks.items() if name != "reference"}
    assert plans["1f1b"].num_stages == 2
    assert plans["interleaved_1f1b"].stage_indices(0) == (0, 2)
    assert plans["interleaved_1f1b_3_per_rank"].stage_indices(1) == (1, 3, 5)
    assert plans["zbv_zero_bubble"].stage_indices(0) == (0, 3)
    assert plans["dualpipev"].n_microbatches == 8
