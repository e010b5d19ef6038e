"""The training loop: step until done or preempted, and on the way log, validate, checkpoint, profile and collect."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from pathlib import Path

import torch

from dtrain.checkpoint import CheckpointManager, PreemptionWatcher
from dtrain.config.schema import JobConfig
from dtrain.metrics import MetricsLogger
from dtrain.observe.compile_cache import PortableCompileCache
from dtrain.observe.compile_report import report_file, write_compile_report
from dtrain.observe.profiling import maybe_memory_snapshot, maybe_profile
from dtrain.parallelize import compile_debug_output, stop_compile_trace
from dtrain.run.layout_report import log_memory, whole_metrics
from dtrain.run.validation import Validator
from dtrain.run.world import World, set_collective_timeout
from dtrain.step.nonfinite import NonFiniteGuard
from dtrain.step.state import TrainState
from dtrain.step.train_step import train_step

logger = logging.getLogger("dtrain")


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
