"""Checkpoints with pipeline stages: DCP save, resume, and resharding between pipeline and FSDP layouts.

The checkpoint is the trainer's: `TrainState.state_dict()` saved with `dcp.save`, and on resume a fresh state's
`state_dict()` filled by `dcp.load` and handed to `TrainState.load_state_dict`. Stages keep the full-model
parameter names and the optimizer state is flattened (keyed by parameter name), so the saved keys do not depend
on the layout and DCP reshards between layouts by name. 2 ranks: ZBVZeroBubble (pp=2, two stages and so two
optimizers per rank), 1F1B (pp=2) and FSDP2 (dp=2, no pipeline); resumes ZBV→ZBV, ZBV→FSDP2 and FSDP2→1F1B.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed.checkpoint as dcp
from dist_harness import run_world
from parity_layouts import (
    GLOBAL_BATCH,
    SEQ_LEN,
    build_parallel_model,
    max_relative_diff,
    mesh_for,
    new_state,
    run_steps,
    whole_model,
)
from test_pipeline_parity import ARGS, PipelineLayout, pipelined_state, reference_run

from dtrain.parallelize import ParallelDims
from dtrain.step.state import TrainState

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SAVE_AT = 3
RESUMED_STEPS = range(SAVE_AT, SAVE_AT + 3)
RESUMES = (("zbv", "zbv"), ("zbv", "fsdp"), ("fsdp", "1f1b"))


def fsdp_state(world_size: int, meshes: dict):
    dims = ParallelDims(world_size, dp_shard=world_size)
    mesh = mesh_for(dims, meshes)
    return new_state(whole_model(build_parallel_model(ARGS, dims, mesh)), dims, mesh), mesh


def restore(state: TrainState, folder: str) -> None:
    """What resuming does: load the checkpoint into this layout's own state dict, then into the state."""
    loaded = state.state_dict()
    dcp.load(loaded, checkpoint_id=folder)
    state.load_state_dict(loaded)


def saved_keys(folder: str) -> list[str]:
    return sorted(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)


def run_checkpoints(rank: int, world_size: int, folder: str) -> dict:
    meshes: dict = {}
    layouts = {
        "zbv": lambda: pipelined_state(PipelineLayout("zbv", "ZBVZeroBubble", microbatch_size=1), world_size, meshes),
        "1f1b": lambda: pipelined_state(PipelineLayout("1f1b", "1F1B", microbatch_size=1), world_size, meshes),
        "fsdp": lambda: fsdp_state(world_size, meshes),
    }
    for saver in ("zbv", "fsdp"):
        state, mesh = layouts[saver]()
        run_steps(state, range(SAVE_AT), mesh, accumulation=1)
        dcp.save(state.state_dict(), checkpoint_id=os.path.join(folder, saver))
    report = {"keys": {saver: saved_keys(os.path.join(folder, saver)) for saver in ("zbv", "fsdp")}}
    for saver, loader in RESUMES:
        state, mesh = layouts[loader]()
        restore(state, os.path.join(folder, saver))
        # Every part's parameter groups, before the first resumed step: the LR schedule must reach all of them.
        group_lrs = [group["lr"] for group in state.optimizer.param_groups]
        result = run_steps(state, RESUMED_STEPS, mesh, accumulation=1)
        report[f"{saver}->{loader}"] = {
            **result, "step": state.step, "tokens_seen": state.tokens_seen, "group_lrs": group_lrs,
            "parts": len(state.model_parts),
        }
    # Computed last, on rank 0 only: the reference needs no other rank, and rank 1 would only compete for cores.
    report["reference"] = reference_run() if rank == 0 else None
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_world(2, run_checkpoints, str(tmp_path_factory.mktemp("pipeline_checkpoints")), timeout_s=240)


def test_pipeline_and_fsdp_checkpoints_hold_the_same_names(report):
    keys = report["keys"]
    assert keys["zbv"] == keys["fsdp"]
    for key in (
        "model.layers.3.feed_forward.w2.weight",
        "optimizer.state.output.weight.exp_avg",
        "optimizer.param_groups.tok_embeddings.weight.lr",
        "lr_scheduler.last_epoch",
        "train.step",
    ):
        assert key in keys["zbv"], key


@pytest.mark.parametrize("resume", [f"{saver}->{loader}" for saver, loader in RESUMES])
def test_resume_continues_the_single_process_curve(report, resume):
    expected, result = report["reference"], report[resume]
    resumed = slice(RESUMED_STEPS.start, RESUMED_STEPS.stop)
    assert result["parts"] == (2 if resume.endswith("zbv") else 1)
    assert result["step"] == RESUMED_STEPS.stop
    assert result["tokens_seen"] == RESUMED_STEPS.stop * GLOBAL_BATCH * SEQ_LEN
    assert max_relative_diff(result["losses"], expected["losses"][resumed]) <= 1e-5
    assert max_relative_diff(result["grad_norms"], expected["grad_norms"][resumed]) <= 1e-4
    assert result["lrs"] == expected["lrs"][resumed]
    assert result["group_lrs"] == [expected["lrs"][SAVE_AT]] * len(result["group_lrs"])
