"""Checkpoints with pipeline stages: DCP save, resume, and resharding between pipeline and FSDP layouts.

Stages keep the full-model parameter names, so the union of the stages' state dicts is the full model's and DCP
reshards between layouts by name. A rank with several stages (ZBVZeroBubble: two) needs one optimizer per stage
for torch's optimizer state-dict helpers (they take one module); `PartOptimizers` drives them as one optimizer,
and the optimizer state is saved flattened (keyed by parameter name), which is also what makes it independent
of the layout. 2 ranks: ZBVZeroBubble (pp=2, two stages per rank), 1F1B (pp=2) and FSDP2 (dp=2, no pipeline).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dist_harness import run_world
from dtrain.config.schema import Optimizer
from dtrain.distributed import dp_summer
from dtrain.models.llama3 import Transformer
from dtrain.optim import build_optimizer
from dtrain.parallelize import (
    ParallelDims,
    ParallelizeOptions,
    build_mesh,
    init_weights_like_single_device,
    parallelize_llama,
)
from test_pipeline_parity import (
    ARGS,
    SEED,
    PipelineLayout,
    build_pipelined,
    max_relative_diff,
    new_state,
    single_process_run,
    train,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
SAVE_AT = 3
RESUMED_STEPS = range(SAVE_AT, SAVE_AT + 3)


class PartOptimizers(torch.optim.Optimizer):
    """One optimizer per model part, stepped as one. Its param_groups are always the parts' current group objects
    (loading an optimizer state dict replaces them), so one LR schedule over it sets every part's rate."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        # Optimizer.__init__ is not called: it would build groups of its own.
        self.optimizers = [build_optimizer([part], Optimizer(lr=1e-2), torch.device("cpu")) for part in parts]
        self.defaults = self.optimizers[0].defaults

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self, closure=None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def checkpoint_state(state) -> dict:
    """Model and optimizer by full parameter name (whatever the layout), the LR schedule's position and step.

    Of the LR schedule only its position is saved: its state_dict also holds one base rate per parameter group,
    and the number of groups depends on the layout (two per stage); the rates themselves travel with the
    optimizer's parameter groups.
    """
    parts, optimizers = state.model_parts, state.optimizer.optimizers
    return {
        "model": {k: v for part in parts for k, v in get_model_state_dict(part).items()},
        "optimizer": {
            k: v for part, opt in zip(parts, optimizers) for k, v in get_optimizer_state_dict(part, opt, options=FLAT).items()
        },
        "lr_schedule_position": state.lr_scheduler.last_epoch,
        "step": state.step,
    }


def restore(state, folder: str) -> None:
    loaded = checkpoint_state(state)
    dcp.load(loaded, checkpoint_id=folder)
    for part, optimizer in zip(state.model_parts, state.optimizer.optimizers):
        # Each part takes its own names out of the merged dicts.
        set_model_state_dict(part, loaded["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(part, optimizer, loaded["optimizer"], options=FLAT)
    rates = [group["lr"] for group in state.optimizer.param_groups]
    schedule = state.lr_scheduler.state_dict()
    state.lr_scheduler.load_state_dict({**schedule, "last_epoch": loaded["lr_schedule_position"], "_last_lr": rates})
    state.step = loaded["step"]


def pipelined_state(schedule: str, world_size: int, meshes: dict):
    layout = PipelineLayout(schedule, schedule, microbatch_size=1)
    pipeline, mesh, loss_context = build_pipelined(layout, world_size, meshes)
    parts = pipeline.model_parts
    state = new_state(parts, 1, dp_summer(mesh), loss_context, optimizer=PartOptimizers(parts))
    return state, pipeline, mesh


def fsdp_state(world_size: int, meshes: dict):
    dims = ParallelDims(world_size, dp_shard=world_size)
    if "fsdp" not in meshes:
        meshes["fsdp"] = build_mesh(dims, "cpu")
    mesh = meshes["fsdp"]
    with torch.device("meta"):
        model = Transformer(ARGS)
    reference = copy.deepcopy(model)
    parallelize_llama(model, mesh, dims, ParallelizeOptions())
    model.to_empty(device="cpu")
    init_weights_like_single_device(model, reference, SEED)
    state = new_state([model], dims.dp_size, dp_summer(mesh), optimizer=PartOptimizers([model]))
    return state, None, mesh


def saved_keys(folder: str) -> list[str]:
    return sorted(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)


def run_checkpoints(rank: int, world_size: int, folder: str) -> dict:
    meshes: dict = {}
    layouts = {
        "zbv": lambda: pipelined_state("ZBVZeroBubble", world_size, meshes),
        "1f1b": lambda: pipelined_state("1F1B", world_size, meshes),
        "fsdp": lambda: fsdp_state(world_size, meshes),
    }
    for saver in ("zbv", "fsdp"):
        state, pipeline, mesh = layouts[saver]()
        train(state, pipeline, range(SAVE_AT), mesh)
        dcp.save(checkpoint_state(state), checkpoint_id=os.path.join(folder, saver))
    report = {"reference": single_process_run(), "keys": {s: saved_keys(os.path.join(folder, s)) for s in ("zbv", "fsdp")}}
    for saver, loader in (("zbv", "zbv"), ("zbv", "fsdp"), ("fsdp", "1f1b")):
        state, pipeline, mesh = layouts[loader]()
        restore(state, os.path.join(folder, saver))
        report[f"{saver}->{loader}"] = {**train(state, pipeline, RESUMED_STEPS, mesh), "step": state.step}
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_world(2, run_checkpoints, str(tmp_path_factory.mktemp("pipeline_checkpoints")), timeout_s=240)


def test_pipeline_and_fsdp_checkpoints_hold_the_same_names(report):
    keys = report["keys"]
    assert keys["zbv"] == keys["fsdp"]
    assert "model.layers.3.feed_forward.w2.weight" in keys["zbv"]
    assert "optimizer.state.output.weight.exp_avg" in keys["zbv"]


@pytest.mark.parametrize("resume", ["zbv->zbv", "zbv->fsdp", "fsdp->1f1b"])
def test_resume_continues_the_single_process_curve(report, resume):
    expected = report["reference"]
    result = report[resume]
    assert result["step"] == RESUMED_STEPS.stop
    assert max_relative_diff(result["losses"], expected["losses"][RESUMED_STEPS.start :]) <= 1e-5
    assert max_relative_diff(result["grad_norms"], expected["grad_norms"][RESUMED_STEPS.start :]) <= 1e-4
    assert result["lrs"] == expected["lrs"][RESUMED_STEPS.start : RESUMED_STEPS.stop]
