"""The training loop's hooks, registered in the order they run: non-finite guard, first-step report, preemption,
metrics, validation, checkpoints, profiler and memory snapshot, GC (see run/hooks.py for how hooks run)."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from pathlib import Path
from typing import Iterator

import torch

from dtrain.checkpoint import CheckpointManager, PreemptionWatcher
from dtrain.config.schema import Comm
from dtrain.config.schema_observe import Compile, Profiling
from dtrain.metrics import MetricsLogger
from dtrain.observe.compile_cache import PortableCompileCache
from dtrain.observe.compile_progress import compile_progress
from dtrain.observe.compile_report import report_file
from dtrain.observe.compile_watch import CompileWatch
from dtrain.observe.profiling import maybe_memory_snapshot, maybe_profile
from dtrain.parallelize import compile_debug_output, stop_compile_trace
from dtrain.run.hooks import Hooks, StepEnd
from dtrain.run.layout_report import log_memory, whole_metrics
from dtrain.run.validation import Validator
from dtrain.run.world import World, set_collective_timeout
from dtrain.step.nonfinite import NonFiniteGuard
from dtrain.step.state import TrainState

logger = logging.getLogger("dtrain")


def training_hooks(
    *,
    gc_freq: int,
    compile: Compile,
    comm: Comm,
    profiling: Profiling,
    world: World,
    run_dir: Path,
    state: TrainState,
    checkpoints: CheckpointManager,
    metrics: MetricsLogger,
    validator: Validator | None,
    compile_cache: PortableCompileCache | None,
) -> Hooks:
    """Every concern of the training loop as a hook, each kind in the order it runs."""
    hooks = Hooks()
    metrics_log = MetricsLog(metrics, state)
    preemption = Preemption(world.world_size)
    nonfinite = NonFinite(world.device)
    compile_watch = CompileWatch(run_dir, world.rank, compile_cache) if compile.enable else None

    # When the loop starts.
    hooks.on_start(metrics_log.start)
    # Python's automatic GC pauses at random steps; collect on a fixed schedule instead.
    hooks.on_start(gc.disable)
    hooks.on_start(preemption.start)
    hooks.on_start(nonfinite.start)

    # Around the whole loop: entered in this order, left in reverse (the compile cache saves last).
    if compile_cache is not None:  # later steps (validation, a last short batch) may have compiled more
        hooks.around_loop(lambda: saved_at_end(compile_cache, state))
    profiler = hooks.around_loop(lambda: maybe_profile(profiling, run_dir, world.rank, start_step=state.step))
    snapshot = hooks.around_loop(
        lambda: maybe_memory_snapshot(profiling, run_dir, world.rank, world.device, start_step=state.step)
    )
    if compile.enable:  # the first step compiles: say so, and that it is still going, until it is done
        hooks.around_first_step(compile_progress)
    debug_folder = compile_debug_folder(compile, run_dir, world.rank)
    if debug_folder:  # the first step runs inside inductor's code dump for this rank
        hooks.around_first_step(lambda: compile_debug_output(str(debug_folder)))

    # After each step, in this order.
    if state.setup.skip_nonfinite_steps == 0:  # else the step itself skips such steps or stops the run
        hooks.add(nonfinite.record)
    hooks.after_first_step(
        lambda end: log_after_first_step(compile, state, run_dir, world.rank, compile_cache, compile_watch)
    )
    if world.distributed:  # start-up is over: from now on a hung collective is an error soon
        hooks.after_first_step(lambda end: set_collective_timeout(comm.train_timeout_seconds))
    hooks.add(preemption.decide)

    def check_before_log_or_save(end: StepEnd) -> None:
        # Never log a diverged run as healthy, never save its state.
        if metrics.should_log(end.step) or checkpoints.save_due(end.step, last=end.last, preempted=end.preempted):
            nonfinite.check()

    hooks.add(check_before_log_or_save)
    hooks.add(metrics_log.log)
    if validator is not None:
        hooks.add(lambda end: validate(validator, metrics, state, end))
    if compile_watch is not None:  # after validation, whose forward without grad compiles again
        hooks.add(lambda end: compile_watch.after_step(end.step))
    hooks.add(lambda end: checkpoints.maybe_save(end.step, last=end.last, preempted=end.preempted))
    if state.setup.replicas.may_discard:
        # Steps the replica groups discard (while too few groups are up, say) still heed a preemption signal, and a
        # lost quorum ends the group; the state is that of the last step done, saved unless its own save is
        # already there.
        hooks.after_discarded_step(preemption.decide)
        hooks.after_discarded_step(
            lambda end: end.preempted and not checkpoints.save_due(end.step) and checkpoints.maybe_save(
                end.step, preempted=True
            )
        )
        hooks.after_discarded_step(lambda end: stop_on_lost_quorum(state, checkpoints, end))
    hooks.add(lambda end: profiler.value.step())
    hooks.add(lambda end: snapshot.value.step())
    hooks.add(lambda end: gc.collect(1), every=gc_freq)

    # After the last step, inside the profiler and snapshot.
    hooks.at_end(nonfinite.check)

    # When the loop is left, done or failed.
    hooks.on_close(gc.enable)
    if compile_watch is not None:  # the final compile report, also of a run preempted or failed
        hooks.on_close(compile_watch.close)
        hooks.on_close(stop_compile_trace)
    hooks.on_close(metrics.close)
    hooks.on_close(preemption.close)
    hooks.on_close(checkpoints.close)
    return hooks


def stop_on_lost_quorum(state: TrainState, checkpoints: CheckpointManager, end: StepEnd) -> None:
    """A replica group whose quorum is lost (its lighthouse gone) saves the last step it did, then ends with one
    line: relaunched once the lighthouse is back, it resumes there and the groups' first step waits for all."""
    lost = state.setup.replicas.lost
    if lost is None:
        return
    if end.first:  # nothing done since the start: its checkpoint (if any) is already the state
        raise type(lost)(f"{lost}; nothing trained since this launch started")
    if checkpoints.save_due(end.step) or checkpoints.maybe_save(end.step, preempted=True):
        checkpoints.wait()
        raise type(lost)(f"{lost}; this group saved step {end.step}: restart the lighthouse and relaunch the groups "
                         "to resume")
    raise type(lost)(f"{lost}; step {end.step} not saved (checkpoint.enable is false, or checkpoint.load_only)")


class MetricsLog:
    """The metrics log line of every `metrics.log_freq`-th step (and the first and last), with its token count."""

    def __init__(self, metrics: MetricsLogger, state: TrainState) -> None:
        self.metrics, self.state = metrics, state
        self.logged_tokens = 0
        self.recoveries = 0.0

    def start(self) -> None:
        self.metrics.start(self.state.step, self.state.tokens_seen)
        self.logged_tokens = self.state.tokens_seen

    def log(self, end: StepEnd) -> None:
        if self.metrics.should_log(end.step):
            # A dataset mixture: each source's tokens so far, which the loader counts from its position.
            metrics = {**whole_metrics(end.metrics), **self.state.dataloader.tokens_seen_by_source()}
            # A replica group that took a live peer's state took its token count too: no throughput for that window.
            recoveries = float(end.metrics.get("ft/recoveries", 0.0))
            tokens = end.tokens_seen - self.logged_tokens if recoveries == self.recoveries else None
            self.metrics.log(end.step, metrics, tokens, tokens_seen=end.tokens_seen)
            self.logged_tokens, self.recoveries = end.tokens_seen, recoveries


class Preemption:
    """Marks the step after which a preemption signal stops the run; all ranks agree on the signal, so they save
    the same step and stop together. The watcher's signal handlers live as long as the loop."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.watcher: PreemptionWatcher | None = None

    def start(self) -> None:
        self.watcher = PreemptionWatcher(self.world_size)

    def decide(self, end: StepEnd) -> None:
        end.preempted = self.watcher.should_stop(end.step)

    def close(self) -> None:
        self.watcher.close()


class NonFinite:
    """The run's first non-finite step, recorded on the device after every step and read before a log or save."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.guard: NonFiniteGuard | None = None

    def start(self) -> None:
        self.guard = NonFiniteGuard(self.device)

    def record(self, end: StepEnd) -> None:
        self.guard.record(end.step, end.metrics["loss"], end.metrics["grad_norm"])

    def check(self) -> None:
        self.guard.check()


def validate(validator: Validator, metrics: MetricsLogger, state: TrainState, end: StepEnd) -> None:
    if validator.due(end.step) and not end.preempted:  # a preempted run saves first
        started = time.perf_counter()
        values = validator.run(state)
        metrics.log_validation(end.step, values, seconds=time.perf_counter() - started)


@contextlib.contextmanager
def saved_at_end(compile_cache: PortableCompileCache, state: TrainState) -> Iterator[None]:
    """Save the compile cache once the loop is done (not when it fails)."""
    yield
    compile_cache.save(state.step)


def compile_debug_folder(compile: Compile, run_dir: Path, rank: int) -> Path | None:
    """This rank's folder for inductor's generated code (compile.debug_dir), or None when that is off."""
    if compile.enable and compile.debug_dir:
        return run_dir / compile.debug_dir / f"rank{rank}"
    return None


def log_after_first_step(
    compile: Compile,
    state: TrainState,
    run_dir: Path,
    rank: int,
    compile_cache: PortableCompileCache | None,
    compile_watch: CompileWatch | None,
) -> None:
    """What only exists once a step has run: optimizer state (memory evidence) and compiled graphs (the compile
    report, written per rank into the run folder and summarised in the log; the portable compile cache)."""
    log_memory(state.model_parts, state.optimizer)
    if compile_watch is not None:
        report = compile_watch.first_step(state.step)
        logger.info(report.format(report_file(run_dir, rank)))
    debug_folder = compile_debug_folder(compile, run_dir, rank)
    if debug_folder:
        code = debug_folder / "torchinductor"
        graphs = len(list(code.iterdir())) if code.is_dir() else 0
        logger.info(f"compile: inductor's code of {graphs} graph(s) compiled in this run's first step is in {code}")
    if compile_cache is not None:
        compile_cache.save(state.step)
