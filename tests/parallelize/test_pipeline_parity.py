"""Pipeline parallel parity: every schedule trains like one process (2 ranks, pp=2, one world for all), two with
document masking, whose document ids every stage needs, and Qwen3-MoE with its auxiliary loss, which each stage
adds to its own backward (one and two stages per rank, and a split backward).

Each layout is built as the trainer builds it: plan, cut the meta model into this rank's stages, parallelize each
stage on the (pp, dp_replicate, dp_shard, tp) mesh, materialize, initialise like one device, and put the stages
into a `TrainState` with one optimizer per stage (`build_optimizers`) and the trainer's step executor, which
builds the schedule (`build_step_executor`). Then STEPS steps of the real `train_step` (whose executor hands
forward and backward to the pipeline and clips over all stages) on the same global batches as the
single-process reference. The helpers here are shared with test_pipeline_fsdp_tp.py (pp × FSDP2
and pp × TP on 4 ranks) and test_pipeline_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import pytest
import torch
from dist_harness import run_world
from parity_converters import float8_training
from parity_layouts import (
    BF16_LOSS_RTOL,
    FAMILY_ARGS,
    FLOAT8_DRIFT_GRAD_NORM_RTOL,
    FLOAT8_DRIFT_LOSS_RTOL,
    GLOBAL_BATCH,
    SEED,
    STEPS,
    family_spec,
    max_relative_diff,
    mesh_for,
    new_state,
    plain,
    run_steps,
    single_process_run,
)

from dtrain.parallelize import (
    ParallelDims,
    ParallelizeOptions,
    init_weights_like_single_device,
    model_fqn,
    pipeline_schedule,
)
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.pipeline_plan import plan_pipeline
from dtrain.parallelize.pipeline_split import split_model
from dtrain.parallelize.torch_compat import SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS
from dtrain.step.state import TrainState

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# Four blocks, so that two ranks can hold two stages each with a block in every stage.
PIPELINE_ARGS = {family: replace(args, n_layers=4) for family, args in FAMILY_ARGS.items()}
ARGS = PIPELINE_ARGS["llama3"]
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class PipelineLayout:
    """One pipelined layout: schedule and degrees; `resharding_guard=False` skips the zero-bubble FSDP guard."""

    name: str
    schedule: str
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    microbatch_size: int = 2
    accumulation: int = 1
    layers_per_stage: int | None = None
    resharding_guard: bool = True
    steps: int = STEPS
    family: str = "llama3"
    attention_mask: str = "causal"
    param_dtype: str = "float32"
    float8_recipe: str | None = None  # train with float8 linears of this recipe (emulated on CPU)

    @property
    def reference(self) -> str | tuple[str, ...]:
        """The single-process run this layout is compared with: the family's (with its mask, compute dtype and
        float8 recipe where they are not the defaults)."""
        extras = tuple(
            value
            for value, default in (
                (self.attention_mask, "causal"), (self.param_dtype, "float32"), (self.float8_recipe, None)
            )
            if value != default
        )
        return (self.family, *extras) if extras else self.family

    @property
    def float8(self) -> dict | None:
        return None if self.float8_recipe is None else dict(recipe_name=self.float8_recipe)

    @property
    def loss_rtol(self) -> float:
        if self.float8_recipe is not None:
            return FLOAT8_DRIFT_LOSS_RTOL
        return LOSS_RTOL if self.param_dtype == "float32" else BF16_LOSS_RTOL

    @property
    def grad_norm_rtol(self) -> float:
        return FLOAT8_DRIFT_GRAD_NORM_RTOL if self.float8_recipe is not None else 10 * self.loss_rtol


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
    PipelineLayout("qwen3_1f1b", "1F1B", family="qwen3"),
    PipelineLayout("qwen3_zbv_zero_bubble", "ZBVZeroBubble", family="qwen3"),
    # The auxiliary loss's statistics are those of a pipeline microbatch: of 4 sequences, as one process's.
    PipelineLayout("qwen3_moe_1f1b", "1F1B", microbatch_size=4, family="qwen3_moe"),
    PipelineLayout("qwen3_moe_interleaved_1f1b", "Interleaved1F1B", microbatch_size=4, family="qwen3_moe"),
    *(
        [PipelineLayout("qwen3_moe_zbv_zero_bubble", "ZBVZeroBubble", microbatch_size=4, family="qwen3_moe")]
        if SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS
        else []
    ),
    # Document ids reach every stage as a keyword argument of the schedule: one stage per rank, and two (V-shaped,
    # with the weight-gradient pass split off).
    PipelineLayout("1f1b_block_causal", "1F1B", attention_mask="block_causal"),
    PipelineLayout("zbv_zero_bubble_block_causal", "ZBVZeroBubble", attention_mask="block_causal"),
    # Each stage's forward under autocast, backward (run by the schedule) outside it.
    PipelineLayout("1f1b_bf16", "1F1B", param_dtype="bfloat16"),
    PipelineLayout("zbv_zero_bubble_bf16", "ZBVZeroBubble", param_dtype="bfloat16"),
    # float8 linears, converted before the model is cut into stages. The pipeline's microbatches of 2 are not one
    # process's microbatches of 4: tensorwise scales differ, and gradients sum in another order, so these agree
    # within float8's noise (parity_layouts' FLOAT8_DRIFT_LOSS_RTOL). torch 2.11 cannot split the backward of
    # float8 matmuls (the config refuses it there), so the zero-bubble layout runs on newer torch only.
    PipelineLayout("1f1b_float8", "1F1B", float8_recipe="tensorwise"),
    *(
        [PipelineLayout("zbv_zero_bubble_float8_rowwise", "ZBVZeroBubble", float8_recipe="rowwise")]
        if SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS
        else []
    ),
]


@contextlib.contextmanager
def without_resharding_guard():
    """build_pipeline as it would be without keep_parameters_gathered (to show the trap it guards against)."""
    saved = pipeline_schedule.keep_parameters_gathered
    pipeline_schedule.keep_parameters_gathered = lambda stages: None
    try:
        yield
    finally:
        pipeline_schedule.keep_parameters_gathered = saved


def pipelined_state(layout: PipelineLayout, world_size: int, meshes: dict) -> tuple[TrainState, ParallelMesh]:
    """This rank's TrainState for `layout` (stages parallelized and initialised like one device, the pipeline
    set) and the world's mesh."""
    dims = ParallelDims(
        world_size, pp=world_size // (layout.dp_shard * layout.tp * layout.cp), dp_shard=layout.dp_shard,
        tp=layout.tp, cp=layout.cp, ep=layout.ep,
    )
    mesh = mesh_for(dims, meshes)
    spec, args = family_spec(layout.family), PIPELINE_ARGS[layout.family]
    plan = plan_pipeline(
        pp=dims.pp, schedule=layout.schedule, decoder=spec.model.model_cls.decoder_layout, n_layers=args.n_layers,
        local_batch_size=GLOBAL_BATCH // (dims.dp_size * layout.accumulation), microbatch_size=layout.microbatch_size,
        layers_per_stage=layout.layers_per_stage, ddp=dims.ddp_enabled,
    )
    with torch.device("meta"):
        model = spec.model.model_cls(args)
    float8 = float8_training(layout.float8, dims)
    if float8 is not None:
        float8.convert(model)
    stages = split_model(model, plan, mesh["pp"].get_local_rank())
    options = ParallelizeOptions(attention_mask=layout.attention_mask, param_dtype=layout.param_dtype)
    for stage in stages:
        spec.parallelize(stage.module, mesh, dims, options)
        stage.module.to_empty(device="cpu")
        init_weights_like_single_device(stage.module, model, SEED)
    guard = contextlib.nullcontext() if layout.resharding_guard else without_resharding_guard()
    with guard:
        state = new_state(stages, dims, mesh, plan, layout.family, options, float8)
    return state, mesh


def run_pipeline_layout(layout: PipelineLayout, world_size: int, meshes: dict) -> dict:
    state, mesh = pipelined_state(layout, world_size, meshes)
    # Every rank's stage weights, whole, by name: together they must be the single-process init.
    local_initial = {model_fqn(n): plain(p.detach()).clone() for part in state.model_parts for n, p in part.named_parameters()}
    initial_per_rank = [None] * world_size
    torch.distributed.all_gather_object(initial_per_rank, local_initial)
    result = run_steps(state, range(layout.steps), mesh, layout.accumulation, layout.attention_mask)
    initial = {name: tensor for rank_initial in initial_per_rank for name, tensor in rank_initial.items()}
    return {**result, "plan": state.setup.executor.pipeline.plan, "initial": initial}


def reference_run(
    family: str = "llama3", attention_mask: str = "causal", param_dtype: str = "float32", float8: dict | None = None
) -> dict:
    """The single-process run of the family's 4-layer model, with its initial weights."""
    run, initial = single_process_run(PIPELINE_ARGS[family], family, attention_mask, float8, param_dtype)
    return {**run, "initial": initial}


def run_layouts(rank: int, world_size: int, layouts: list[PipelineLayout]) -> dict:
    """Rank 0's report: the reference run of each family (and attention mask) and, per layout, every pp rank's
    losses (they must agree)."""
    # Only rank 0 reports; the other ranks would only compete with it for the cores.
    wanted = {layout.reference: layout for layout in layouts}
    report = {
        "reference": {
            key: reference_run(layout.family, layout.attention_mask, layout.param_dtype, layout.float8)
            for key, layout in wanted.items()
        }
        if rank == 0
        else None
    }
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


@pytest.fixture(scope="module")
def report_2_ranks():
    return run_world(2, run_layouts, SCHEDULES_2_RANKS, timeout_s=240)


def assert_matches_single_process(report: dict, layout: PipelineLayout) -> None:
    name = layout.name
    result, reference = report[name], report["reference"][layout.reference]
    assert sorted(result["initial"]) == sorted(reference["initial"])  # stages keep the full-model names
    assert max((result["initial"][k] - v).abs().max().item() for k, v in reference["initial"].items()) == 0.0
    assert len(result["losses"]) == STEPS
    assert max_relative_diff(result["losses"], reference["losses"]) <= layout.loss_rtol, name
    # The auxiliary loss (MoE), summed over the stages, as one process reports it.
    assert len(result["aux_losses"]) == len(reference["aux_losses"]), name
    if reference["aux_losses"]:
        assert max_relative_diff(result["aux_losses"], reference["aux_losses"]) <= layout.loss_rtol, name
    assert max_relative_diff(result["grad_norms"], reference["grad_norms"]) <= layout.grad_norm_rtol, name
    assert result["lrs"] == reference["lrs"]
    assert result["losses"][-1] < result["losses"][0]
    # The loss is computed on the last stage's rank; every rank logs the same value.
    assert all(losses == result["losses"] for losses in result["losses_per_rank"])


@pytest.mark.parametrize("layout", SCHEDULES_2_RANKS, ids=lambda layout: layout.name)
def test_schedule_matches_single_process(report_2_ranks, layout):
    assert_matches_single_process(report_2_ranks, layout)


def test_schedules_ran_the_planned_stages(report_2_ranks):
    plans = {name: result["plan"] for name, result in report_2_ranks.items() if name != "reference"}
    assert plans["1f1b"].num_stages == 2
    assert plans["interleaved_1f1b"].stage_indices(0) == (0, 2)
    assert plans["interleaved_1f1b_3_per_rank"].stage_indices(1) == (1, 3, 5)
    assert plans["zbv_zero_bubble"].stage_indices(0) == (0, 3)
    assert plans["dualpipev"].n_microbatches == 8
