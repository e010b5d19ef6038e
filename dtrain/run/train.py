"""A training run from the pre-flight's result to its end: build the TrainState from the config, then loop.

`train` reads top to bottom in the order things must happen: distributed world, run-folder lock, layout, state,
checkpoints (restored), the loop's hooks, the loop. The loop itself only fetches a batch, calls `train_step` and
runs the hooks (run/loop_hooks.py registers them); each part receives the config sections it reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from dtrain.checkpoint import CheckpointManager
from dtrain.config import to_toml
from dtrain.config.schema import Comm, JobConfig
from dtrain.config.toml_io import config_to_dict
from dtrain.errors import DtrainError, first_line
from dtrain.fault_tolerance.replica_groups import join_replica_groups
from dtrain.fault_tolerance.semi_sync import semi_sync
from dtrain.metrics import MetricsLogger
from dtrain.metrics.liveness import doing
from dtrain.observe.compile_cache import PortableCompileCache, graph_settings
from dtrain.reliability.earlier_run import set_aside_earlier_run
from dtrain.reliability.run_lock import locked_run_folder
from dtrain.run.build_state import LossBuilder, build_train_state, whole_model_params
from dtrain.run.layout import build_layout
from dtrain.run.layout_report import compute_dtype, describe_layout, log_parallel_plans
from dtrain.run.hooks import Hooks
from dtrain.run.loop import run_loop
from dtrain.run.loop_hooks import training_hooks
from dtrain.run.prepare import Prepared, model_description
from dtrain.run.validation import build_validator
from dtrain.run.world import World, init_world, is_timeout
from dtrain.step.rng import set_determinism
from dtrain.step.state import TrainState

logger = logging.getLogger("dtrain")

# Registers more hooks, given the loop's hooks, the state, the metrics logger and the run folder.
AddHooks = Callable[[Hooks, TrainState, MetricsLogger, Path], None]


def write_run_files(cfg: JobConfig, world: World, run_dir: Path) -> None:
    """Write the resolved config into the run directory (rank 0 only): config.toml, and the JSON copy that
    torchtitan's job.save_config_file asks for. The whole config is what it writes, as data."""
    if world.rank == 0:
        (run_dir / "config.toml").write_text(to_toml(cfg))
        if cfg.job.save_config_file:
            json_file = run_dir / cfg.job.save_config_file
            json_file.parent.mkdir(parents=True, exist_ok=True)
            json_file.write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")


def train(
    cfg: JobConfig, prepared: Prepared, build_loss: LossBuilder | None = None, add_hooks: AddHooks | None = None
) -> None:
    """Run the configured training to completion, starting from what `prepare` resolved; reads the whole
    config: it assembles the run. `build_loss` builds its loss when that is not the token cross-entropy;
    `add_hooks` registers the hooks of a package above this one (evaluation) after the run's own."""
    family, tokenizer, args = prepared.family, prepared.tokenizer, prepared.model_args
    with contextlib.ExitStack() as stack:
        world = stack.enter_context(init_world(cfg.comm.init_timeout_seconds))
        # Locked before anything is built or written: a second launch into a live run's folder ends here.
        run_dir = stack.enter_context(locked_run_folder(Path(cfg.job.dump_folder), world.rank, world.distributed))
        doing("building the model, optimizer and data (a chat or preference data pass tokenizes every row)")
        layout = build_layout(cfg, world, family, args)
        set_determinism(cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
        state = build_train_state(cfg, world, layout, family, args, tokenizer, build_loss)
        validator = build_validator(cfg.validation, cfg.training, cfg.debug.seed, layout.rank, tokenizer, world.device)
        checkpoints = CheckpointManager(
            cfg.checkpoint, run_dir, world.rank, world.world_size, state, training=cfg.training,
            parallelism=cfg.parallelism, model=cfg.model, optimizer=cfg.optimizer, model_args=args, lora=cfg.lora,
        )
        if cfg.checkpoint.create_seed_checkpoint:
            write_run_files(cfg, world, run_dir)
            checkpoints.save_seed_checkpoint()
            checkpoints.close()
            return
        doing("reading the checkpoint to start from")
        startup = checkpoints.restore_at_startup()
        if cfg.fault_tolerance.enable:  # after the restore: the quorum compares the groups' steps
            doing("joining the replica groups")
            replicas = join_replica_groups(
                cfg.fault_tolerance, cfg.comm, world.rank, world.world_size, world.device, state
            )
            stack.callback(replicas.close)
            state.setup = replace(state.setup, replicas=replicas)
            stack.enter_context(semi_sync(cfg.fault_tolerance, replicas.manager, state))
        # Only now is the run accepted: a refused resume leaves an existing run folder as it was.
        if world.rank == 0:  # a new run never appends to an earlier run's metrics (a rejoining group continues)
            set_aside_earlier_run(run_dir, cfg.metrics, startup.rule == "resume" or cfg.fault_tolerance.enable)
        if world.distributed and cfg.metrics.save_for_all_ranks:  # each rank opens its files once they are moved
            dist.barrier()
        write_run_files(cfg, world, run_dir)
        accumulation = layout.dims.gradient_accumulation_steps(
            cfg.training.local_batch_size, cfg.training.global_batch_size
        )
        metrics = MetricsLogger(
            cfg.metrics,
            run_dir,
            cfg.training.steps,
            rank=world.rank,
            world_size=world.world_size,
            num_flops_per_token=family.model.flops_per_token(args, cfg.training.seq_len),
            device=world.device,
            dtype=compute_dtype(layout),
            run_config=config_to_dict(cfg),  # the resolved config, as data for the sinks' run records
        )
        logger.info(
            "model %s: %.3fM parameters; %s; %d microbatch(es) of %d x %d per step on each of %d dp rank(s)",
            model_description(cfg.model, cfg.checkpoint), whole_model_params(family.model, args) / 1e6,
            describe_layout(layout), accumulation, cfg.training.local_batch_size, cfg.training.seq_len,
            layout.rank.dp_size,
        )
        log_parallel_plans(family, layout, state.model_parts)
        compile_cache = None
        if cfg.compile.enable and cfg.compile.cache:
            settings = graph_settings(cfg, world.world_size)  # its key hashes the resolved config's values
            compile_cache = PortableCompileCache.for_run(settings, cfg.compile, cfg.job.dump_folder, world.rank)
            compile_cache.load()
        hooks = training_hooks(
            gc_freq=cfg.training.gc_freq, compile=cfg.compile, comm=cfg.comm, profiling=cfg.profiling, world=world,
            run_dir=run_dir, state=state, checkpoints=checkpoints, metrics=metrics, validator=validator,
            compile_cache=compile_cache,
        )
        if add_hooks is not None:
            add_hooks(hooks, state, metrics, run_dir)
        try:
            preempted = run_loop(state, cfg.training.steps, accumulation, world.device, hooks)
        except Exception as err:
            if world.distributed and is_timeout(err):
                raise timed_out(cfg.comm, err) from err
            raise
        if preempted:
            logger.info("stopped at step %d on a preemption signal; rerun the same command to resume", state.step)
        else:
            saved = "" if cfg.checkpoint.enable else (
                "; no checkpoint saved (checkpoint.enable = false): nothing to generate from, export or resume")
            logger.info("training done: %d steps, %d tokens, outputs in %s%s", state.step, state.tokens_seen, run_dir,
                        saved)


def timed_out(comm: Comm, err: BaseException) -> DtrainError:
    first = first_line(err)
    return DtrainError(
        f"a collective timed out, so a rank hung or died (comm.init_timeout_seconds = "
        f"{comm.init_timeout_seconds} until the first step is done, comm.train_timeout_seconds = "
        f"{comm.train_timeout_seconds} after): {first}"
    )
