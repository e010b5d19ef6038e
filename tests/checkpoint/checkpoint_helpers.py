"""A tiny model's TrainState (Llama 3 unless a family is named) on synthetic data, and a training loop that saves
as the trainer's does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dtrain.checkpoint import CheckpointManager
from dtrain.config.schema import JobConfig
from dtrain.data import build_dataloader, build_tokenizer
from dtrain.models.llama3 import Llama3Args, RopeScaling
from dtrain.models.qwen3 import QWEN3_FLAVORS
from dtrain.parallelize import get_family
from dtrain.step.executor import LocalExecutor, StepExecutor
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.rng import seed_everything
from dtrain.step.state import RankCoordinates, StepSetup, TrainState
from dtrain.step.train_step import StepLoss, train_step

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY_ARGS = Llama3Args(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, multiple_of=32, ffn_dim_multiplier=None,
    max_seq_len=32, rope_scaling=RopeScaling(),
)
# Qwen3's debug flavor (tied head, head_dim apart from dim / n_heads) shrunk to the same size.
TINY_QWEN3_ARGS = replace(
    QWEN3_FLAVORS["debugmodel"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=96,
    vocab_size=320, max_seq_len=32,
)
FAMILY_ARGS = {"llama3": TINY_ARGS, "qwen3": TINY_QWEN3_ARGS}


def tiny_model(family: str = "llama3") -> torch.nn.Module:
    return get_family(family).model.model_cls(FAMILY_ARGS[family])


def make_cfg(run_dir: Path, steps: int = 6, family: str = "llama3", **checkpoint) -> JobConfig:
    """A config for the family's tiny model on synthetic data, checkpointing enabled every 2 steps unless
    overridden."""
    cfg = JobConfig()
    cfg.model.name = family
    cfg.job.dump_folder = str(run_dir)
    cfg.model.tokenizer = "byte"
    cfg.training.dataset = "synthetic"
    cfg.training.seq_len = 16
    cfg.training.local_batch_size = 2
    cfg.training.steps = steps
    cfg.lr_scheduler.warmup_steps = 2
    cfg.optimizer.lr = 1e-2
    cfg.checkpoint.enable = True
    cfg.checkpoint.interval = 2
    cfg.checkpoint.last_save_model_only = True  # what the tests of the final save's kinds start from
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


def tiny_state(cfg: JobConfig, model: torch.nn.Module | None = None, dp_rank: int = 0, dp_size: int = 1,
               rank: RankCoordinates | None = None, executor: StepExecutor | None = None) -> TrainState:
    """The TrainState the trainer would build for cfg.model.name's tiny model (a given, e.g. sharded, model replaces
    the default) as data-parallel rank `dp_rank` of `dp_size`, or at `rank` in a layout with its `executor`
    (default: the whole model, plain loss)."""
    rank = rank or RankCoordinates(dp_rank=dp_rank, dp_size=dp_size)
    if model is None:
        seed_everything(cfg.debug.seed, "init")
        model = tiny_model(cfg.model.name)
    optimizer = build_optimizers([model], cfg.optimizer, torch.device("cpu"))
    return TrainState(
        model_parts=[model],
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_scheduler),
        dataloader=build_dataloader(
            cfg.training, build_tokenizer(cfg.model), rank.dp_rank, rank.dp_size, seed=cfg.debug.seed
        ),
        setup=StepSetup(
            executor or LocalExecutor(StepLoss()), seed=cfg.debug.seed, max_norm=cfg.training.max_norm, rank=rank
        ),
    )


def manager_for(cfg: JobConfig, state: TrainState, rank: int = 0, world_size: int = 1,
                model_args: Any = None) -> CheckpointManager:
    """The trainer's CheckpointManager for `cfg` (model_args: those of cfg.model.name's tiny model unless given)."""
    return CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, rank, world_size, state, training=cfg.training,
        parallelism=cfg.parallelism, model=cfg.model, optimizer=cfg.optimizer,
        model_args=model_args or FAMILY_ARGS[cfg.model.name],
    )


def train(state: TrainState, manager: CheckpointManager | None, until: int, cfg: JobConfig) -> list[float]:
    """Step to `until` as the trainer's loop does (save after each step); the losses of the steps run."""
    losses = []
    while state.step < until:
        metrics = train_step(state, [next(state.dataloader)])
        loss = metrics["loss"]
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
        if manager is not None:
            manager.maybe_save(state.step, last=state.step == cfg.training.steps)
    return losses
