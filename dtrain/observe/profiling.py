"""Opt-in performance tooling around the training loop: torch.profiler traces and CUDA memory snapshots.

Both are context managers that yield an object whose ``step()`` the loop calls once after every train step; when
the feature is disabled they yield a stepper that does nothing, so the loop has no branches (the trainer registers
both as hooks around its loop, run/loop_hooks.py)::

    with maybe_profile(cfg.profiling, dump_folder, rank, start_step) as profiler, \\
         maybe_memory_snapshot(cfg.profiling, dump_folder, rank, device, start_step) as memory_snapshot:
        for step in ...:
            train_step(...); profiler.step(); memory_snapshot.step()

The window schedule (``profile_freq``, ``profiler_warmup``, ``profiler_active``), the files each window writes
(trace, top-operator table and phase split via profiler_events.py, memory timeline, snapshots, ``oom/``) and how
to open them: docs/profiling.md, "Profiler".
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity

from dtrain.config.schema_observe import Profiling
from dtrain.errors import ConfigError
from dtrain.observe.compile_report import compiled_frame_names
from dtrain.observe.profiler_events import format_phase_split, name_compiled_graphs, phase_split
from dtrain.observe.profiler_table import format_table, operator_tables, write_tables

logger = logging.getLogger(__name__)

# Allocator events kept by the memory history: enough for several steps of a large model, bounded in host memory.
MEMORY_HISTORY_MAX_ENTRIES = 100_000
# Above every level of kineto's logger (its highest, USDT, is 5): see _profiler_windows.
KINETO_SILENT_LOG_LEVEL = "6"


class NoOpStepper:
    """Stands in for a profiler or snapshotter when the feature is off."""

    def step(self) -> None:
        """Nothing is being recorded."""


def check_profiling_config(profiling: Profiling, device: torch.device) -> None:
    """Raise ConfigError if the [profiling] section cannot work as configured on ``device``.

    Call it while validating the config, before any run directory or process group exists; the context
    managers below repeat their part of it themselves.
    """
    _check_profiler_window(profiling)
    _check_memory_snapshot_device(profiling, device)


def _check_profiler_window(profiling: Profiling) -> None:
    if profiling.enable_profiling and profiling.profiler_warmup + profiling.profiler_active > profiling.profile_freq:
        raise ConfigError(
            f"profiling.profiler_warmup ({profiling.profiler_warmup}) + profiling.profiler_active "
            f"({profiling.profiler_active}) must be <= profiling.profile_freq ({profiling.profile_freq}); "
            "lower the warmup/active steps or raise profiling.profile_freq"
        )


def _check_memory_snapshot_device(profiling: Profiling, device: torch.device) -> None:
    if profiling.enable_memory_snapshot and device.type != "cuda":
        raise ConfigError(
            "profiling.enable_memory_snapshot needs CUDA (torch.cuda.memory._record_memory_history); "
            f"this run is on {device.type} — set profiling.enable_memory_snapshot = false"
        )


def maybe_profile(
    profiling: Profiling, dump_folder: str | os.PathLike, rank: int, start_step: int = 0
) -> AbstractContextManager[ProfilerWindows | NoOpStepper]:
    """A torch.profiler recording one window every profile_freq steps, or a no-op when profiling is off.

    ``start_step`` is the step the loop resumes after, so trace folders carry the true training step. Traces
    include CPU activity always and CUDA kernels when CUDA is available. Raises ConfigError at once (not on
    entering) when the window does not fit in profile_freq.
    """
    if not profiling.enable_profiling:
        return nullcontext(NoOpStepper())
    _check_profiler_window(profiling)
    return _profiler_windows(profiling, Path(dump_folder) / profiling.save_traces_folder, rank, start_step)


class ProfilerWindows:
    """The loop's handle on the profiler: ``step()`` advances its schedule, which starts and ends the windows."""

    def __init__(self, profiler: torch.profiler.profile, messages: Path):
        self.profiler = profiler
        self.messages = messages

    def step(self) -> None:
        """Count one finished train step; a window that this step closes is written out."""
        with _warnings_to(self.messages):
            self.profiler.step()


@contextmanager
def _profiler_windows(
    profiling: Profiling, traces_folder: Path, rank: int, start_step: int
) -> Iterator[ProfilerWindows]:
    on_cuda = torch.cuda.is_available()
    memory_timeline = profiling.profile_memory and on_cuda
    if rank == 0 and profiling.profile_memory:
        logger.info(
            "profiling.profile_memory: recording shapes and stacks too (the CUDA memory timeline needs them)"
            if on_cuda
            else "profiling.profile_memory: the memory timeline needs CUDA and is skipped on this CPU run; the "
            "traces still carry the allocation events"
        )
    closing = False

    def write_window(profiler: torch.profiler.profile) -> None:
        # Leaving the profiler mid-window also fires this; such a window is cut short (possibly before any of
        # its steps ran), so it is dropped rather than written under a step it does not cover.
        if closing:
            return
        # step_num has already advanced past the window, so it is the 1-based number of its last recorded step.
        folder = traces_folder / f"iteration_{profiler.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{rank}_trace.json"
        profiler.export_chrome_trace(str(path))
        logger.info(f"profiler trace written to {path}")
        if profiling.top_ops:
            _write_operator_tables(profiler, profiling, folder, rank, on_cuda)
        if memory_timeline:
            _export_memory_timeline(profiler, folder, rank)

    activities = [ProfilerActivity.CPU]
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(
        wait=profiling.profile_freq - profiling.profiler_warmup - profiling.profiler_active,
        warmup=profiling.profiler_warmup,
        active=profiling.profiler_active,
        repeat=0,
    )
    # Kineto, the profiler's C++ side, writes straight to stderr: "USDT: ... profiler_start/profiler_stop" at
    # every window and, on some builds, ERROR lines about GPUs it cannot query. Its threshold is read from
    # KINETO_LOG_LEVEL once, when the first profiler of the process starts; one above its highest level (USDT = 5)
    # silences it. A level the user set is kept, to see those lines again.
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT_LOG_LEVEL)
    messages = traces_folder / f"rank{rank}_profiler.log"
    profiler = torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=write_window,
        record_shapes=profiling.record_shapes or memory_timeline,
        with_stack=profiling.with_stack or memory_timeline,
        profile_memory=profiling.profile_memory,
    )
    with _warnings_to(messages):
        profiler.__enter__()
    # The schedule is periodic in step_num, so starting it at the resumed step keeps windows on the same
    # training steps as in an uninterrupted run.
    profiler.step_num = start_step
    try:
        yield ProfilerWindows(profiler, messages)
    finally:
        closing = True
        with _warnings_to(messages):
            profiler.__exit__(None, None, None)


def _write_operator_tables(
    profiler: torch.profiler.profile, profiling: Profiling, folder: Path, rank: int, on_cuda: bool
) -> None:
    # Renamed in place before they are summed up: the trace, exported already, keeps torch's names.
    name_compiled_graphs(profiler.events(), compiled_frame_names())
    split = phase_split(profiler.events())
    events = profiler.key_averages(group_by_input_shape=profiling.record_shapes)
    columns = {"with_device": on_cuda, "with_shapes": profiling.record_shapes}
    tables = operator_tables(events, profiling.top_ops, **columns)
    path = write_tables(tables, split, folder, rank, steps=profiling.profiler_active, **columns)
    if rank == 0:
        logger.info(
            f"profiler window {folder.name}, rank 0, times summed over {profiling.profiler_active} step(s) "
            f"(all tables in {path}):\n{format_table(tables[0], **columns)}\n{format_phase_split(split)}"
        )


def _export_memory_timeline(profiler: torch.profiler.profile, folder: Path, rank: int) -> None:
    # The HTML page (a plot) needs matplotlib; without it the timeline's points are written as JSON.
    suffix = "html" if importlib.util.find_spec("matplotlib") else "json"
    path = folder / f"rank{rank}_memory_timeline.{suffix}"
    try:
        profiler.export_memory_timeline(str(path), device=f"cuda:{torch.cuda.current_device()}")
    except Exception as error:  # an extra export through a deprecated torch API: report it, keep training
        logger.warning(f"profiler memory timeline not written: {type(error).__name__}: {error}")
        return
    logger.info(f"profiler memory timeline written to {path}")


@contextmanager
def _warnings_to(path: Path) -> Iterator[None]:
    """Warnings raised inside the profiler go to ``path`` instead of the log: they are about the profiler, not
    the training (e.g. that each window drops the previous window's events, which is what the windows are for)."""
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield
        finally:
            if caught:
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as log:
                    for w in caught:
                        log.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))


class MemorySnapshotter:
    """Records the CUDA caching allocator's history and dumps it every ``every`` steps."""

    def __init__(self, folder: Path, rank: int, every: int, start_step: int):
        self.folder = folder
        self.rank = rank
        self.every = every
        self.step_num = start_step

    def step(self) -> None:
        """Count one finished train step; dump a snapshot when it closes a window."""
        self.step_num += 1
        if self.step_num % self.every == 0:
            self.dump(f"iteration_{self.step_num}")

    def dump(self, subfolder: str) -> Path:
        """Write the allocator history recorded so far to ``<folder>/<subfolder>/rank<r>_memory_snapshot.pickle``."""
        target = self.folder / subfolder
        target.mkdir(parents=True, exist_ok=True)
        path = target / f"rank{self.rank}_memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        logger.info(f"memory snapshot written to {path}")
        return path


def maybe_memory_snapshot(
    profiling: Profiling, dump_folder: str | os.PathLike, rank: int, device: torch.device, start_step: int = 0
) -> AbstractContextManager[MemorySnapshotter | NoOpStepper]:
    """CUDA allocator history with a snapshot every profile_freq steps, or a no-op when snapshots are off.

    Enter it before building the model to see the model's own allocations in the snapshot. Raises ConfigError at
    once (before training) when snapshots are asked for on a device other than CUDA.
    """
    if not profiling.enable_memory_snapshot:
        return nullcontext(NoOpStepper())
    _check_memory_snapshot_device(profiling, device)
    return _memory_history(profiling, Path(dump_folder) / profiling.save_memory_snapshot_folder, rank, start_step)


@contextmanager
def _memory_history(profiling: Profiling, folder: Path, rank: int, start_step: int) -> Iterator[MemorySnapshotter]:
    snapshotter = MemorySnapshotter(folder, rank, profiling.profile_freq, start_step)
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_MAX_ENTRIES)
    try:
        yield snapshotter
    except torch.OutOfMemoryError:
        # The history at the moment of the failure is what explains it; keep it before the error propagates.
        snapshotter.dump("oom")
        raise
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
