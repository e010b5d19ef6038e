"""Validation loss on 2 ranks: FSDP2, DDP, TP+SP (loss parallel), CP, EP and pipeline schedules (1F1B,
Interleaved1F1B, ZBVZeroBubble, DualPipeV) give one process's val_loss (fp32, 1e-5), one world for all.

Each layout is built as the trainer builds it and evaluated with the trainer's `validation_loss` (the executor's
forward-only path: the whole model, or the pipeline schedule's `eval`) before training, after 2 steps and after 4,
on validation batches of another shape than training's (VAL_BATCH sequences of VAL_SEQ_LEN tokens, some labels
ignored), each dp rank its slice. Training continues between evaluations, and its losses must still be one
process's that never evaluated: an evaluation leaves the model (mode, buffers such as MoE load counts, FSDP and
pipeline state) as training had it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from dist_harness import run_world
from parity_layouts import (
    SEED,
    TOKEN_IDS,
    build_parallel_model,
    family_spec,
    max_relative_diff,
    mesh_for,
    microbatches,
    new_state,
    plain,
    whole_model,
)
from test_pipeline_parity import PIPELINE_ARGS, PipelineLayout, pipelined_state

from dtrain.parallelize import ParallelDims, ParallelizeOptions
from dtrain.run.validation import validation_loss
from dtrain.run.world import dp_rank_and_size
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.train_step import train_step

pytestmark = pytest.mark.multiprocess

VAL_BATCH = 4
VAL_SEQ_LEN = 8
VAL_BATCHES = 2
# Evaluate at these steps (0: before training) while training for TRAIN_STEPS steps.
EVAL_AT = (0, 2, 4)
TRAIN_STEPS = 4
RTOL = 1e-5


@dataclass(frozen=True)
class ValLayout:
    name: str
    degrees: dict = field(default_factory=dict)
    family: str = "llama3"
    schedule: str | None = None  # pipeline parallel over the 2 ranks with this schedule
    microbatch_size: int = 2


LAYOUTS = [
    ValLayout("fsdp", dict(dp_shard=2)),
    ValLayout("ddp", dict(dp_replicate=2, dp_shard=1)),
    ValLayout("tp_sp", dict(tp=2, dp_shard=1)),
    ValLayout("cp", dict(cp=2, dp_shard=1)),
    # Loss-free balancing counts expert loads in buffers during forward; an evaluation must not count.
    ValLayout("moe_ep", dict(dp_shard=2, ep=2), family="qwen3_moe_bias"),
    ValLayout("pp_1f1b", schedule="1F1B"),
    ValLayout("pp_interleaved_1f1b", schedule="Interleaved1F1B"),
    ValLayout("pp_zbv_zero_bubble", schedule="ZBVZeroBubble", microbatch_size=1),
    ValLayout("pp_dualpipev", schedule="DualPipeV", microbatch_size=1),
]


def validation_batches(dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """This dp rank's slice of each of the VAL_BATCHES global validation batches."""
    generator = torch.Generator().manual_seed(777)
    batches, size = [], VAL_BATCH // dp_size
    for index in range(VAL_BATCHES):
        shape = (VAL_BATCH, VAL_SEQ_LEN + 1)
        tokens = TOKEN_IDS[torch.randint(0, len(TOKEN_IDS), shape, generator=generator)]
        labels = tokens[:, 1:].clone()
        labels[index, : 2 + index] = IGNORE_INDEX  # uneven valid-token counts across ranks
        rows = slice(dp_rank * size, (dp_rank + 1) * size)
        batches.append({"input_ids": tokens[rows, :-1].contiguous(), "labels": labels[rows].contiguous()})
    return batches


def train_and_validate(state, mesh, evaluate: bool = True) -> dict:
    """TRAIN_STEPS steps of `train_step` (2 accumulated microbatches per dp rank), with `validation_loss` at
    EVAL_AT: the val losses and the training losses."""
    dp_rank, dp_size = dp_rank_and_size(mesh)
    val_losses, losses = [], []
    for step in range(TRAIN_STEPS + 1):
        if evaluate and step in EVAL_AT:
            val_losses.append(validation_loss(state, validation_batches(dp_rank, dp_size)).item())
        if step < TRAIN_STEPS:
            metrics = train_step(state, microbatches(step, dp_rank, dp_size, 2))
            losses.append(plain(metrics["loss"]).item())
    modes = {module.training for part in state.model_parts for module in part.modules()}
    return {"val_losses": val_losses, "losses": losses, "train_mode": modes == {True}}


def single_process(family: str, evaluate: bool) -> dict:
    """The plain single-device recipe (meta, to_empty, seed, init_weights) of the family's 4-layer model."""
    with torch.device("meta"):
        model = family_spec(family).model.model_cls(PIPELINE_ARGS[family])
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    return train_and_validate(new_state(whole_model(model), family=family), None, evaluate)


def run_layout(layout: ValLayout, world_size: int, meshes: dict) -> dict:
    if layout.schedule is not None:
        pipeline = PipelineLayout(
            layout.name, layout.schedule, microbatch_size=layout.microbatch_size, accumulation=2, family=layout.family
        )
        state, mesh = pipelined_state(pipeline, world_size, meshes)
        return train_and_validate(state, mesh)
    dims = ParallelDims(world_size, **layout.degrees)
    mesh = mesh_for(dims, meshes)
    model = build_parallel_model(PIPELINE_ARGS[layout.family], dims, mesh, ParallelizeOptions(), layout.family)
    state = new_state(whole_model(model), dims, mesh, family=layout.family)
    return train_and_validate(state, mesh)


def run_layouts(rank: int, world_size: int, layouts: list[ValLayout]) -> dict:
    families = sorted({layout.family for layout in layouts})
    report = {
        "reference": {family: single_process(family, evaluate=True) for family in families} if rank == 0 else {},
        "no_eval": {family: single_process(family, evaluate=False) for family in families} if rank == 0 else {},
    }
    meshes: dict = {}
    for layout in layouts:
        result = run_layout(layout, world_size, meshes)
        every_rank = [None] * world_size
        torch.distributed.all_gather_object(every_rank, result["val_losses"])
        report[layout.name] = {**result, "val_losses_per_rank": every_rank}
    return report


@pytest.fixture(scope="module")
def report():
    return run_world(2, run_layouts, LAYOUTS, timeout_s=300)


def test_evaluating_leaves_training_as_it_was(report):
    for family, run in report["reference"].items():
        assert run["losses"] == report["no_eval"][family]["losses"], family
        assert run["train_mode"]
    # The model learns, so the validation loss of these repetitive tokens falls.
    llama = report["reference"]["llama3"]["val_losses"]
    assert llama[-1] < llama[0]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_val_loss_matches_single_process(report, layout):
    result, reference = report[layout.name], report["reference"][layout.family]
    assert len(result["val_losses"]) == len(EVAL_AT)
    assert max_relative_diff(result["val_losses"], reference["val_losses"]) <= RTOL
    # Every rank reports the same value.
    assert all(losses == result["val_losses"] for losses in result["val_losses_per_rank"])
    # Training after the evaluations is still one process's training without them.
    assert max_relative_diff(result["losses"], report["no_eval"][layout.family]["losses"]) <= RTOL
    assert result["train_mode"]
