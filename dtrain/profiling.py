"""Opt-in performance tooling around the training loop: torch.profiler traces and CUDA memory snapshots.

Both are context managers that yield an object whose ``step()`` the loop calls once after every train step; when
the feature is disabled they yield a stepper that does nothing, so the loop has no branches::

    with maybe_profile(cfg.profiling, dump_folder, rank, start_step) as profiler, \\
         maybe_memory_snapshot(cfg.profiling, dump_folder, rank, device, start_step) as memory_snapshot:
        for step in ...:
            train_step(...)
            profiler.step()
            memory_snapshot.step()

Every ``profiling.profile_freq`` steps the profiler records a window: ``profile_freq - warmup - active`` idle
steps, ``profiler_warmup`` steps traced but discarded (the profiler's own start-up cost lands there), then
``profiler_active`` recorded steps, written as ``<save_traces_folder>/iteration_<step>/rank<r>_trace.json``
(open in chrome://tracing or https://ui.perfetto.dev); a window that training ends in the middle of is not
written. Memory snapshots are dumped on the same cadence as
``<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle`` (open in
https://pytorch.org/memory_viz), and once more under ``oom/`` if the run dies of a CUDA out-of-memory error.
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity

from dtrain.config.schema import Profiling
from dtrain.errors import ConfigError

logger = logging.getLogger(__name__)

# Allocator events kept by the memory history: enough for several steps of a large model, bounded in host memory.
MEMORY_HISTORY_MAX_ENTRIES = 100_000


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
) -> AbstractContextManager[torch.profiler.profile | NoOpStepper]:
    """A torch.profiler recording one window every profile_freq steps, or a no-op when profiling is off.

    ``start_step`` is the step the loop resumes after, so trace folders carry the true training step. Traces
    include CPU activity always and CUDA kernels when CUDA is available. Raises ConfigError at once (not on
    entering) when the window does not fit in profile_freq.
    """
    if not profiling.enable_profiling:
        return nullcontext(NoOpStepper())
    _check_profiler_window(profiling)
    return _profiler_windows(profiling, Path(dump_folder) / profiling.save_traces_folder, rank, start_step)


@contextmanager
def _profiler_windows(
    profiling: Profiling, traces_folder: Path, rank: int, start_step: int
) -> Iterator[torch.profiler.profile]:
    closing = False

    def write_trace(profiler: torch.profiler.profile) -> None:
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

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(
        wait=profiling.profile_freq - profiling.profiler_warmup - profiling.profiler_active,
        warmup=profiling.profiler_warmup,
        active=profiling.profiler_active,
        repeat=0,
    )
    with torch.profiler.profile(
        activities=activities, schedule=schedule, on_trace_ready=write_trace, record_shapes=True
    ) as profiler:
        # The schedule is periodic in step_num, so starting it at the resumed step keeps windows on the same
        # training steps as in an uninterrupted run.
        profiler.step_num = start_step
        try:
            yield profiler
        finally:
            closing = True


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
