"""One live run per run folder: a lock file that names its holder (pid, host, start time).

Two launches of the same command would otherwise train into one folder at once and overwrite each other's
checkpoints. The lock is created atomically (O_EXCL), so of two racing launches exactly one wins. A lock left by a
process that died on this host (kill -9, a crash) is taken over with a log line, and so is one left by an earlier
incarnation of this SLURM job, whose rank 0 may now be on another host: a requeued job (SLURM starts it only once
the previous allocation has ended) or workers torchrun restarted (it stops every worker of an attempt before the
next one starts). One held by a live process, or by a process on another
host (whose liveness cannot be checked from here), is refused in one line that says how to clear it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from dtrain.errors import DtrainError

logger = logging.getLogger(__name__)

LOCK_FILE = ".dtrain.lock"


class RunFolderInUse(DtrainError):
    """Another live run holds the run folder."""


@dataclass(frozen=True)
class LockHolder:
    pid: int
    host: str
    started: str
    slurm_job: str = ""  # SLURM_JOB_ID, "" outside SLURM (and in locks written before it was recorded)
    slurm_restart: int = 0  # SLURM_RESTART_COUNT: how often SLURM had requeued that job
    elastic_restart: int = 0  # TORCHELASTIC_RESTART_COUNT: how often torchrun had restarted the workers

    def describe(self) -> str:
        job = (
            f", SLURM job {self.slurm_job} (requeue {self.slurm_restart}, worker restart {self.elastic_restart})"
            if self.slurm_job else ""
        )
        return f"pid {self.pid} on {self.host}, started {self.started}{job}"

    def earlier_incarnation_of(self, other: LockHolder) -> bool:
        """Whether this holder is `other`'s own SLURM job before a requeue or a worker restart: that run has ended.
        (SLURM job ids are unique; outside SLURM nothing identifies a job across hosts.)"""
        return (
            bool(self.slurm_job)
            and self.slurm_job == other.slurm_job
            and (self.slurm_restart, self.elastic_restart) < (other.slurm_restart, other.elastic_restart)
        )


def _this_process() -> LockHolder:
    return LockHolder(
        os.getpid(), socket.gethostname(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        slurm_job=os.environ.get("SLURM_JOB_ID", ""), slurm_restart=int(os.environ.get("SLURM_RESTART_COUNT") or 0),
        elastic_restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def _read_holder(path: Path) -> LockHolder | None:
    """The holder recorded in `path`, or None when the file is gone or unreadable (a torn write by a dead run)."""
    try:
        return LockHolder(**json.loads(path.read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


class RunLock:
    """The lock on `folder`, taken by `acquire` and given back by `release` (also usable as a context manager)."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self.holder = _this_process()
        self._held = False

    def acquire(self) -> None:
        # After removing a stale lock another launch may win the race to create it; then that one is live.
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._clear_stale_or_refuse()
                continue
            with os.fdopen(fd, "w") as file:
                file.write(json.dumps(asdict(self.holder)))
            self._held = True
            return
        raise RunFolderInUse(f"run folder {self.path.parent}: other launches keep taking its lock {self.path}")

    def _clear_stale_or_refuse(self) -> None:
        other = _read_holder(self.path)
        if (
            other is None
            or (other.host == self.holder.host and not _pid_alive(other.pid))
            or other.earlier_incarnation_of(self.holder)
        ):
            what = other.describe() if other else "an unreadable lock"
            logger.warning("run folder %s: taking over the lock of a run that is gone (%s)", self.path.parent, what)
            self.path.unlink(missing_ok=True)
            return
        hint = (
            "stop it, or use another job.dump_folder"
            if other.host == self.holder.host
            else f"if that run has ended, delete {self.path}; or use another job.dump_folder"
        )
        raise RunFolderInUse(f"run folder {self.path.parent} is in use by {other.describe()}; {hint}")

    def release(self) -> None:
        """Remove the lock if this process still holds it (never another run's)."""
        if self._held and _read_holder(self.path) == self.holder:
            self.path.unlink(missing_ok=True)
        self._held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def locked_run_folder(folder: Path, rank: int, distributed: bool) -> Iterator[Path]:
    """`folder`, created and locked by rank 0 for the duration of the block; every rank raises a refusal, so a
    refused launch ends on all ranks at once instead of leaving the others waiting in their first collective."""
    lock = RunLock(folder)
    refusal: list[str | None] = [None]
    created = rank == 0 and not folder.exists()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire()
        except RunFolderInUse as err:
            refusal[0] = str(err)
    if distributed:
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise RunFolderInUse(refusal[0])
    try:
        yield folder
    finally:
        lock.release()
        if created:
            # A run refused at start-up (bad data, say) leaves no trace, not even the folder it made; rmdir
            # removes only an empty folder (another rank may be writing into it still).
            with contextlib.suppress(OSError):
                folder.rmdir()
