"""What each rank of a spawned gloo world runs for the resharding tests: train under one layout with checkpoints,
then continue from one of them under another layout in the same world; load Hugging Face weights under both.

Layouts come from the real parallelize package (FSDP2 / TP / both), so the state dicts DCP sees are the ones the
trainer produces. Every layout trains on the same global batches, so losses can be compared across layouts.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from checkpoint_helpers import TINY_ARGS, make_cfg, manager_for, tiny_state, train
from torch.distributed.tensor import DTensor

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import iter_hf_weights, load_hf_weights
from dtrain.models.llama3.hf_adapter import Llama3HFAdapter

from dtrain.distributed import dp_rank_and_size, dp_summer
from dtrain.models.llama3 import Transformer
from dtrain.parallelize import (
    ParallelDims,
    ParallelizeOptions,
    build_mesh,
    init_weights_like_single_device,
    local_loss,
    loss_parallel_context,
)
from dtrain.parallelize.llama3 import parallelize_llama
from dtrain.step import cross_entropy_sum

STEPS, SAVED_STEP = 6, 4


def layout_state(cfg, degrees: dict, world_size: int, global_batch: int):
    """The TrainState of the tiny model laid out by `degrees` (ParallelDims names), on `global_batch` sequences."""
    dims = ParallelDims(world_size, **degrees)
    mesh = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = Transformer(TINY_ARGS)
    reference = copy.deepcopy(model)
    parallelize_llama(model, mesh, dims, ParallelizeOptions())
    model.to_empty(device="cpu")
    init_weights_like_single_device(model, reference, cfg.debug.seed)
    dp_rank, dp_size = dp_rank_and_size(mesh)
    cfg.training.local_batch_size = global_batch // dp_size
    cfg.parallelism.data_parallel_shard_degree = dims.dp_shard
    cfg.parallelism.tensor_parallel_degree = dims.tp
    return tiny_state(
        cfg, model=model, dp_rank=dp_rank, dp_size=dp_size, reduce_over_dp=dp_summer(mesh),
        loss_fn=local_loss(cross_entropy_sum), loss_context=lambda: loss_parallel_context(dims),
    )


def hf_import_matches(cfg, degrees: dict, world_size: int, batch: int, hf_dir: str) -> bool:
    """Whether Hugging Face weights load into the layout `degrees` exactly (each rank cutting its own shards)."""
    state = layout_state(cfg, degrees, world_size, batch)
    adapter = Llama3HFAdapter(TINY_ARGS)
    load_hf_weights(state.model_parts, Path(hf_dir), adapter)
    loaded = model_state_dict(state.model_parts)
    expected = dict(iter_hf_weights(Path(hf_dir), adapter, list(loaded)))
    return all(
        torch.equal(value.full_tensor() if isinstance(value, DTensor) else value, expected[fqn])
        for fqn, value in loaded.items()
    )


def train_then_continue_elsewhere(
    rank: int, world_size: int, root: str, first: dict, second: dict, batch: int, async_mode: str = "disabled"
):
    """Train STEPS steps under `first` (saving every 2, in `async_mode`), then restart from step SAVED_STEP
    under `second`; also load the HF weights in <root>/hf under both layouts.

    Returns both runs' losses; the second run's start step and the checkpoint it restored; whether the HF weights
    loaded exactly under each layout.
    """
    root = Path(root)
    cfg = make_cfg(root / "first", steps=STEPS, async_mode=async_mode)
    state = layout_state(cfg, first, world_size, batch)
    manager = manager_for(cfg, state, rank, world_size)
    manager.restore_at_startup()
    first_losses = train(state, manager, STEPS, cfg)
    manager.close()

    saved = root / "first" / "checkpoint" / f"step-{SAVED_STEP}"
    cfg = make_cfg(root / "second", steps=STEPS, initial_load_path=str(saved), initial_load_model_only=False)
    state = layout_state(cfg, second, world_size, batch)
    manager = manager_for(cfg, state, rank, world_size)
    startup = manager.restore_at_startup()
    second_losses = train(state, manager, STEPS, cfg)
    manager.close()
    hf = [hf_import_matches(cfg, degrees, world_size, batch, str(root / "hf")) for degrees in (first, second)]
    return {"first": first_losses, "second": second_losses, "start": startup.step, "saved": str(saved), "hf": hf}
