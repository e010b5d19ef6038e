"""The training loop: build the TrainState from the config, then step, log and profile until done.

Setup reads top to bottom in the order things must happen: distributed world, tokenizer, model on the meta
device, parallelize, materialize and initialise, optimizer and schedule, data, state. The loop itself only
fetches a batch, calls `train_step` and hands the returned tensors to the metrics logger every `log_freq` steps.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from pathlib import Path

import torch

from dtrain.config import to_toml
from dtrain.config.toml_io import config_to_dict
from dtrain.checks import Prepared, model_description
from dtrain.checkpoint import CheckpointManager, PreemptionWatcher
from dtrain.compile_cache import PortableCompileCache
from dtrain.compile_report import report_file, watch_graph_breaks, write_compile_report
from dtrain.config.schema import JobConfig
from dtrain.data import build_dataloader
from dtrain.distributed import World, init_world, is_timeout, set_collective_timeout
from dtrain.errors import DtrainError, first_line
from dtrain.float8 import build_float8_training
from dtrain.mx import build_mx_training
from dtrain.layout import ParallelLayout, build_layout
from dtrain.layout_report import compute_dtype, describe_layout, log_memory, log_parallel_plans, whole_metrics
from dtrain.lr_schedule import build_lr_scheduler
from dtrain.memory_preflight import Workload
from dtrain.metrics import MetricsLogger
from dtrain.model_builder import build_model_parts
from dtrain.models import ModelFamily, count_params
from dtrain.nonfinite import NonFiniteGuard
from dtrain.optim import build_optimizers
from dtrain.parallelize import FamilySpec, compile_debug_output, compile_kwargs, stop_compile_trace
from dtrain.profiling import maybe_memory_snapshot, maybe_profile
from dtrain.rng import set_determinism
from dtrain.run_lock import locked_run_folder
from dtrain.state import TrainState
from dtrain.step import cross_entropy_sum, train_step
from dtrain.step_executor import build_step_executor
from dtrain.validation import Validator, build_validator

logger = logging.getLogger("dtrain")


def build_train_state(
    cfg: JobConfig, world: World, layout: ParallelLayout, family: FamilySpec, args, tokenizer
) -> TrainState:
    """Model parts (meta → parallelized → materialized → initialised), optimizer, schedule, data and the executor
    of this layout, as one state."""
    # At most one low-precision converter (the config refuses float8 with mx).
    converter = build_float8_training(cfg, layout.dims.fsdp_enabled, world.device) or build_mx_training(cfg)
    stages = build_model_parts(
        family, args, layout, world.device, seed=cfg.debug.seed, workload=Workload.of(cfg, layout),
        convert=converter.convert if converter else None,
    )
    model_parts = [stage.module for stage in stages]
    optimizer = build_optimizers(model_parts, cfg.optimizer, world.device)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_scheduler)
    rank = layout.rank
    dataloader = build_dataloader(cfg.training, tokenizer, rank.dp_rank, rank.dp_size, seed=cfg.debug.seed)
    logger.info(f"data: {dataloader.description}")
    loss_fn = cross_entropy_sum
    if cfg.compile.enable:
        watch_graph_breaks()  # compiling is lazy: the breaks happen in the first step, reported after it
        if "loss" in cfg.compile.components:
            c = cfg.compile
            loss_fn = torch.compile(loss_fn, **compile_kwargs(c.backend, c.mode, c.fullgraph, c.dynamic))
    return TrainState(
        model_parts=model_parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataloader=dataloader,
        executor=build_step_executor(
            family, layout, stages, loss_fn, world.device, converter.optimizer_step_hook if converter else None
        ),
        seed=cfg.debug.seed,
        max_norm=cfg.training.max_norm,
        skip_nonfinite_steps=cfg.training.skip_nonfinite_steps,
        rank=rank,
    )


def whole_model_params(family: ModelFamily, args) -> int:
    """Parameters of the whole model, whatever part of it this rank holds (built on meta: free)."""
    with torch.device("meta"):
        return count_params(family.model_cls(args))


def write_run_files(cfg: JobConfig, world: World, run_dir: Path) -> None:
    """Write the resolved config into the run directory (rank 0 only): config.toml, and the JSON copy that
    torchtitan's job.save_config_file asks for."""
    if world.rank == 0:
        (run_dir / "config.toml").write_text(to_toml(cfg))
        if cfg.job.save_config_file:
            json_file = run_dir / cfg.job.save_config_file
            json_file.parent.mkdir(parents=True, exist_ok=True)
            json_file.write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")


def train(cfg: JobConfig, prepared: Prepared) -> None:
    """Run the configured training to completion, starting from what `checks.prepare` resolved."""
    family, tokenizer, args = prepared.family, prepared.tokenizer, prepared.model_args
    with contextlib.ExitStack() as stack:
        world = stack.enter_context(init_world(cfg.comm.init_timeout_seconds))
        # Locked before anything is built or written: a second launch into a live run's folder ends here.
        run_dir = stack.enter_context(locked_run_folder(Path(cfg.job.dump_folder), world.rank, world.distributed))
        layout = build_layout(cfg, world, family, args)
        set_determinism(cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
        state = build_train_state(cfg, world, layout, family, args, tokenizer)
        validator = build_validator(cfg, layout.rank, tokenizer, world.device)
        checkpoints = CheckpointManager(cfg, run_dir, world.rank, world.world_size, state, model_args=args)
        if cfg.checkpoint.create_seed_checkpoint:
            write_run_files(cfg, world, run_dir)
            checkpoints.save_seed_checkpoint()
            checkpoints.close()
            return
        checkpoints.restore_at_startup()
        # Only now is the run accepted: a refused resume leaves an existing run folder as it was.
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
            run_config=config_to_dict(cfg),
        )
        logger.info(
            "model %s: %.3fM parameters; %s; %d microbatch(es) of %d x %d per step on each of %d dp rank(s)",
            model_description(cfg), whole_model_params(family.model, args) / 1e6, describe_layout(layout),
            accumulation, cfg.training.local_batch_size, cfg.training.seq_len, layout.rank.dp_size,
        )
        log_parallel_plans(family, layout)
        compile_cache = None
        if cfg.compile.enable and cfg.compile.cache:
            compile_cache = PortableCompileCache.for_run(cfg, world.rank, world.world_size)
            compile_cache.load()
        try:
            preempted = run_loop(
                cfg, world, state, run_dir, checkpoints, metrics, accumulation, validator, compile_cache
            )
        except Exception as err:
            if world.distributed and is_timeout(err):
                raise timed_out(cfg, err) from err
            raise
        if preempted:
            logger.info("stopped at step %d on a preemption signal; rerun the same command to resume", state.step)
        else:
            logger.info("training done: %d steps, %d tokens, outputs in %s", state.step, state.tokens_seen, run_dir)


def run_loop(
    cfg: JobConfig,
    world: World,
    state: TrainState,
    run_dir: Path,
    checkpoints: CheckpointManager,
    metrics: MetricsLogger,
    accumulation: int,
    validator: Validator | None = None,
    compile_cache: PortableCompileCache | None = None,
) -> bool:
    """Step until `training.steps` or a preemption signal (then True): log, validate, checkpoint, profile on the
    way."""
    data = iter(state.dataloader)
    start_step = state.step
    metrics.start(state.step, state.tokens_seen)
    logged_tokens = state.tokens_seen
    stop = False
    # Python's automatic GC pauses at random steps; collect on a fixed schedule instead.
    gc.disable()
    preemption = PreemptionWatcher(world.world_size)
    nonfinite = NonFiniteGuard(world.device)
    try:
        with (
            maybe_profile(cfg.profiling, run_dir, world.rank, start_step=state.step) as profiler,
            maybe_memory_snapshot(cfg.profiling, run_dir, world.rank, world.device, start_step=state.step) as snapshot,
        ):
            while state.step < cfg.training.steps and not stop:
                batch = [to_device(next(data), world.device) for _ in range(accumulation)]
                with step_context(cfg, run_dir, world.rank, first=state.step == start_step):
                    step_metrics = train_step(state, batch)
                if state.skip_nonfinite_steps == 0:  # else the step itself skips such steps or stops the run
                    nonfinite.record(state.step, step_metrics["loss"], step_metrics["grad_norm"])
                if state.step == start_step + 1:
                    log_after_first_step(cfg, state, run_dir, world.rank, compile_cache)
                    if world.distributed:  # start-up is over: from now on a hung collective is an error soon
                        set_collective_timeout(cfg.comm.train_timeout_seconds)
                # All ranks agree on the signal, so they save the same step and stop together.
                stop = preemption.should_stop(state.step)
                last = state.step == cfg.training.steps
                log_now = metrics.should_log(state.step)
                if log_now or checkpoints.save_due(state.step, last=last, preempted=stop):
                    nonfinite.check()  # never log a diverged run as healthy, never save its state
                if log_now:
                    metrics.log(state.step, whole_metrics(step_metrics), state.tokens_seen - logged_tokens)
                    logged_tokens = state.tokens_seen
                if validator is not None and validator.due(state.step) and not stop:  # a preempted run saves first
                    started = time.perf_counter()
                    values = validator.run(state)
                    metrics.log_validation(state.step, values, seconds=time.perf_counter() - started)
                checkpoints.maybe_save(state.step, last=last, preempted=stop)
                profiler.step()
                snapshot.step()
                if state.step % cfg.training.gc_freq == 0:
                    gc.collect(1)
            nonfinite.check()
        if compile_cache is not None:  # later steps (validation, a last short batch) may have compiled more
            compile_cache.save(state.step)
    finally:
        gc.enable()
        metrics.close()
        preemption.close()
        checkpoints.close()
    return stop


def timed_out(cfg: JobConfig, err: BaseException) -> DtrainError:
    first = first_line(err)
    return DtrainError(
        f"a collective timed out, so a rank hung or died (comm.init_timeout_seconds = "
        f"{cfg.comm.init_timeout_seconds} until the first step is done, comm.train_timeout_seconds = "
        f"{cfg.comm.train_timeout_seconds} after): {first}"
    )


def compile_debug_folder(cfg: JobConfig, run_dir: Path, rank: int) -> Path | None:
    """This rank's folder for inductor's generated code (compile.debug_dir), or None when that is off."""
    if cfg.compile.enable and cfg.compile.debug_dir:
        return run_dir / cfg.compile.debug_dir / f"rank{rank}"
    return None


def step_context(cfg: JobConfig, run_dir: Path, rank: int, *, first: bool) -> contextlib.AbstractContextManager:
    """Where a step runs: the first one, with compile.debug_dir, inside inductor's code dump for this rank."""
    folder = compile_debug_folder(cfg, run_dir, rank)
    return compile_debug_output(str(folder)) if first and folder else contextlib.nullcontext()


def log_after_first_step(
    cfg: JobConfig, state: TrainState, run_dir: Path, rank: int, compile_cache: PortableCompileCache | None
) -> None:
    """What only exists once a step has run: optimizer state (memory evidence) and compiled graphs (the compile
    report, written per rank into the run folder and summarised in the log; the portable compile cache)."""
    log_memory(state.model_parts, state.optimizer)
    if cfg.compile.enable:
        stop_compile_trace()
        report = write_compile_report(run_dir, rank, compile_cache.loaded if compile_cache else None)
        logger.info(report.format(report_file(run_dir, rank)))
    debug_folder = compile_debug_folder(cfg, run_dir, rank)
    if debug_folder:
        code = debug_folder / "torchinductor"
        graphs = len(list(code.iterdir())) if code.is_dir() else 0
        logger.info(f"compile: inductor's code of {graphs} graph(s) compiled in this run's first step is in {code}")
    if compile_cache is not None:
        compile_cache.save(state.step)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
