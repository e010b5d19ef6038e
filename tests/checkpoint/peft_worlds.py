"""What each rank of a spawned gloo world runs for the sharded LoRA checkpoint tests: a LoRA run from a Hugging
Face base and a PEFT adapter under FSDP2, saving adapter-only checkpoints, then one of them resumed under TP."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from checkpoint_helpers import FAMILY_ARGS, tiny_model, tiny_state, train
from reshard_worlds import whole

from dtrain.checkpoint import CheckpointManager
from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.parallelize import ParallelDims, ParallelizeOptions, build_mesh, get_family, init_weights_like_single_device
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.precision.lora import apply_lora, init_lora_weights
from dtrain.run.build_state import build_step_executor
from dtrain.run.layout import ParallelLayout, rank_coordinates
from dtrain.step.train_step import StepLoss

GLOBAL_BATCH = 2


def lora_layout_state(cfg, degrees: dict, world_size: int):
    """The TrainState of the tiny Llama 3 with cfg.lora's adapters, laid out by `degrees` (ParallelDims names), its
    weights and adapters those of a single-process init."""
    dims = ParallelDims(world_size, **degrees)
    mesh = build_mesh(dims, "cpu")
    family = get_family("llama3")
    with torch.device("meta"):
        model = tiny_model("llama3")
    apply_lora(model, cfg.lora)
    reference = copy.deepcopy(model)
    family.parallelize(model, mesh, dims, ParallelizeOptions())
    model.to_empty(device="cpu")
    init_weights_like_single_device(model, reference, cfg.debug.seed)
    init_lora_weights(model, cfg.debug.seed)
    layout = ParallelLayout(dims, ParallelizeOptions(), mesh, rank=rank_coordinates(mesh))
    cfg.training.local_batch_size = GLOBAL_BATCH // layout.rank.dp_size
    cfg.parallelism.data_parallel_shard_degree = dims.dp_shard
    cfg.parallelism.tensor_parallel_degree = dims.tp
    executor = build_step_executor(family, layout, [StageModule(0, model)], StepLoss.build(dims), torch.device("cpu"))
    return tiny_state(cfg, model=model, rank=layout.rank, executor=executor)


def start(cfg, degrees: dict, rank: int, world_size: int):
    state = lora_layout_state(cfg, degrees, world_size)
    manager = CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, rank, world_size, state, training=cfg.training,
        parallelism=cfg.parallelism, model=cfg.model, optimizer=cfg.optimizer, model_args=FAMILY_ARGS["llama3"],
        lora=cfg.lora,
    )
    manager.restore_at_startup()
    return state, manager


def fsdp_then_tp(rank: int, world_size: int, cfg_path: str) -> dict:
    """Train the run of `cfg_path` (a pickled config) for 4 steps under FSDP2 from its base and adapter; then
    resume its step-2 checkpoint under TP and train to step 4. Rank 0 reports the adapters right after the start,
    both runs' losses and what step-2 holds."""
    cfg = torch.load(cfg_path, weights_only=False)
    state, manager = start(cfg, {"dp_shard": 2}, rank, world_size)
    started = {fqn: whole(t).clone() for fqn, t in model_state_dict(state.model_parts).items()}
    fsdp = train(state, manager, 4, cfg)
    manager.close()

    cfg.checkpoint.load_step = 2
    state, manager = start(cfg, {"dp_shard": 1, "tp": 2}, rank, world_size)
    resumed_at = state.step
    tp = train(state, None, 4, cfg)
    manager.close()
    return {"started": started, "fsdp": fsdp, "tp": tp, "resumed_at": resumed_at,
            "step2": str(Path(cfg.job.dump_folder) / "checkpoint" / "step-2")}
