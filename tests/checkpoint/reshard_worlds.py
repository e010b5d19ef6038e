"""What each rank of a spawned gloo world runs for the resharding tests, for every model family in turn: train
under one layout with checkpoints, then continue from one of them under another layout in the same world; start
from Hugging Face weights and from a torchtitan >= 0.3 checkpoint under both.

Layouts come from the real parallelize package (FSDP2 / TP / both), so the state dicts DCP sees are the ones the
trainer produces. Every layout trains on the same global batches, so losses can be compared across layouts.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoint_helpers import FAMILY_ARGS, make_cfg, manager_for, tiny_model, tiny_state, train
from torch.distributed.tensor import DTensor

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import iter_hf_weights, load_hf_weights
from dtrain.parallelize import ParallelDims, ParallelizeOptions, build_mesh, get_family, init_weights_like_single_device
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.run.build_state import build_step_executor
from dtrain.run.layout import ParallelLayout, rank_coordinates
from dtrain.step.train_step import StepLoss

STEPS, SAVED_STEP = 6, 4
FAMILIES = tuple(FAMILY_ARGS)


def layout_state(cfg, degrees: dict, world_size: int, global_batch: int, model_args=None):
    """The TrainState of cfg.model.name's tiny model (or its model of `model_args`) laid out by `degrees`
    (ParallelDims names), on `global_batch` sequences."""
    dims = ParallelDims(world_size, **degrees)
    mesh = build_mesh(dims, "cpu")
    family = get_family(cfg.model.name)
    with torch.device("meta"):
        model = tiny_model(cfg.model.name) if model_args is None else family.model.model_cls(model_args)
    reference = copy.deepcopy(model)
    family.parallelize(model, mesh, dims, ParallelizeOptions())
    model.to_empty(device="cpu")
    init_weights_like_single_device(model, reference, cfg.debug.seed)
    layout = ParallelLayout(dims, ParallelizeOptions(), mesh, rank=rank_coordinates(mesh))
    cfg.training.local_batch_size = global_batch // layout.rank.dp_size
    cfg.parallelism.data_parallel_shard_degree = dims.dp_shard
    cfg.parallelism.tensor_parallel_degree = dims.tp
    cfg.parallelism.expert_parallel_degree = dims.ep
    loss = StepLoss.build(dims)
    executor = build_step_executor(family, layout, [StageModule(0, model)], loss, torch.device("cpu"))
    return tiny_state(cfg, model=model, rank=layout.rank, executor=executor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def hf_import_matches(cfg, degrees: dict, world_size: int, batch: int, hf_dir: Path) -> bool:
    """Whether Hugging Face weights load into the layout `degrees` exactly (each rank cutting its own shards)."""
    state = layout_state(cfg, degrees, world_size, batch)
    adapter = get_family(cfg.model.name).model.hf_adapter(FAMILY_ARGS[cfg.model.name])
    load_hf_weights(state.model_parts, hf_dir, adapter)
    loaded = model_state_dict(state.model_parts)
    expected = dict(iter_hf_weights(hf_dir, adapter, list(loaded)))
    return all(torch.equal(whole(value), expected[fqn]) for fqn, value in loaded.items())


def torchtitan_start_matches(root: Path, family: str, degrees: dict, rank: int, world_size: int, batch: int) -> bool:
    """Whether <root>/torchtitan (torchtitan >= 0.3's names of <root>/weights.pt) starts a run under `degrees`
    (checkpoint.initial_load_path) with exactly those weights."""
    cfg = make_cfg(root / "from_torchtitan", family=family, initial_load_path=str(root / "torchtitan"))
    state = layout_state(cfg, degrees, world_size, batch)
    assert manager_for(cfg, state, rank, world_size).restore_at_startup().rule == "initial_load"
    loaded = {fqn: whole(value) for fqn, value in model_state_dict(state.model_parts).items()}
    expected = torch.load(root / "weights.pt")
    return loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def torchtitan_start_on_uneven_stages(root: Path, family: str, rank: int, world_size: int) -> bool:
    """Whether the torchtitan checkpoint loads exactly into pipeline-like stages that hold different weights: rank 0
    the whole model, the others no blocks, so they read no whole tensors and join rank 0's reads with empty ones."""
    torch.manual_seed(rank)
    model = tiny_model(family)
    if rank > 0:
        for index in list(model.layers):
            del model.layers[index]
    cfg = make_cfg(root / "stages", family=family, initial_load_path=str(root / "torchtitan"))
    state = tiny_state(cfg, model=model)
    manager_for(cfg, state, rank, world_size).restore_at_startup()
    expected = torch.load(root / "weights.pt")
    exact = torch.tensor([all(torch.equal(v, expected[fqn]) for fqn, v in model_state_dict(state.model_parts).items())])
    dist.all_reduce(exact, op=dist.ReduceOp.MIN)  # rank 0 answers for all
    return bool(exact)


def train_then_continue_elsewhere(
    rank: int, world_size: int, root: str, first: dict, second: dict, batch: int, async_mode: str = "disabled"
):
    """For every family (<root>/<family>), train STEPS steps under `first` (saving every 2, in `async_mode`), then
    restart from step SAVED_STEP under `second`; also start from the HF weights in <root>/<family>/hf and from the
    torchtitan checkpoint in <root>/<family>/torchtitan under both layouts.

    Returns, by family: both runs' losses; the second run's start step and the checkpoint it restored; whether the
    HF weights loaded exactly under each layout; whether the torchtitan checkpoint did, also into uneven
    pipeline-like stages.
    """
    reports = {}
    for family in FAMILIES:
        folder = Path(root) / family
        cfg = make_cfg(folder / "first", steps=STEPS, family=family, async_mode=async_mode)
        state = layout_state(cfg, first, world_size, batch)
        manager = manager_for(cfg, state, rank, world_size)
        manager.restore_at_startup()
        first_losses = train(state, manager, STEPS, cfg)
        manager.close()

        saved = folder / "first" / "checkpoint" / f"step-{SAVED_STEP}"
        cfg = make_cfg(folder / "second", steps=STEPS, family=family, initial_load_path=str(saved),
                       initial_load_model_only=False)
        state = layout_state(cfg, second, world_size, batch)
        manager = manager_for(cfg, state, rank, world_size)
        startup = manager.restore_at_startup()
        second_losses = train(state, manager, STEPS, cfg)
        manager.close()
        layouts = (first, second)
        reports[family] = {
            "first": first_losses, "second": second_losses, "start": startup.step, "saved": str(saved),
            "hf": [hf_import_matches(cfg, degrees, world_size, batch, folder / "hf") for degrees in layouts],
            "torchtitan": [
                torchtitan_start_matches(folder, family, degrees, rank, world_size, batch) for degrees in layouts
            ],
            "torchtitan_stages": torchtitan_start_on_uneven_stages(folder, family, rank, world_size),
        }
    return reports
