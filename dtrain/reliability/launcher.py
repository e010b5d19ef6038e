"""What run_train.sh runs torchrun under, so that a multi-process run ends like a single-process one: with one
`error: ...` line (the first failing rank's) and exit != 0, not torchrun's 40-line failure report.

`python -m dtrain.reliability.launcher LAUNCH_DIR torchrun ARGS...` starts torchrun in its own session and
passes the workers' lines through while torchrun's own go to a log file (kept in the run folder as
torchrun-<time>.log); forwards SIGTERM, SIGUSR1 and SIGINT to torchrun once each; when torchrun fails, prints
the line of the rank that caused it (a rank killed by a signal, else the first line a worker left in
LAUNCH_DIR/errors via `record_failure`, else torchrun's last line); names a rank that stopped making progress
(StallWatch: a SIGSTOPped worker is killed as soon as a peer fails, a hung one is named from torchrun's log);
and dies with torchrun's whole tree (PR_SET_PDEATHSIG, parent_watch.py).

Each of these is a guarantee with its test in docs/reliability.md (the launcher rows of its table).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Iterable

ERROR_DIR_ENV = "DTRAIN_ERROR_DIR"


def record_outcome(failed: bool, line: str) -> None:
    """Leave how this worker ended (a failure's one line, or that it finished) for the launcher; a no-op outside
    run_train.sh's torchrun."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return
    line = line.strip().splitlines()[0] if line.strip() else "failed"
    kind = "failed" if failed else "ok"
    Path(folder, f"rank{os.environ.get('RANK', '0')}").write_text(f"{time.time()}\n{kind}\n{line}\n")


def record_failure(message: str) -> None:
    record_outcome(True, message)


def filter_output(report: IO[str], lines: Iterable[str], out: IO[str], lock: threading.Lock | None = None) -> None:
    """Workers' lines (`[rank...`) to `out`, torchrun's own lines to `report`."""
    lock = lock or threading.Lock()
    for line in lines:
        if line.startswith("[rank"):
            out.write(line)
            out.flush()
        else:
            with lock:
                report.write(line)


def outcomes(error_dir: Path) -> list[tuple[float, str, str, str]]:
    """(time, rank, "ok" | "failed", line) of every worker that recorded how it ended, earliest first."""
    found = []
    for file in error_dir.glob("rank*"):
        when, kind, line = (file.read_text().split("\n") + ["", ""])[:3]
        found.append((float(when), file.name.removeprefix("rank"), kind, line.strip()))
    return sorted(found)


# One failure in torchrun's report (ChildFailedError): "  rank      : 1 (local_rank: 1)" then
# "  exitcode  : -9 (pid: 123) (SIGKILL)"; a negative exit code is the signal that ended the worker.
_REPORTED_RANK = re.compile(r"^\s*rank\s*: (\d+) \(local_rank")
_REPORTED_EXIT = re.compile(r"^\s*exitcode\s*: (-?\d+) ")
# NCCL's watchdog aborts the survivors of a failed peer: a SIGABRT is more often a consequence than a cause.
_SECONDARY_SIGNALS = {signal.SIGABRT}
# torchrun ends the workers of a failed attempt with SIGTERM and, those still running 30 s later, with SIGKILL:
# "Unable to shutdown process 123 via 15, forcefully exiting via 9" names such a hung worker by its PID.
_FORCED_KILL = re.compile(r"Unable to shutdown process (\d+) via")
# How the trainer's line for a collective that timed out begins (dtrain/run/train.py `timed_out`): a peer stopped
# making progress.
COLLECTIVE_TIMEOUT = "a collective timed out"


def killed_ranks(report: Path) -> list[tuple[str, str]]:
    """(rank, signal name) of each worker that torchrun's report says a signal ended, lowest rank first."""
    killed, rank = {}, None
    for line in report.read_text(errors="replace").splitlines():
        if match := _REPORTED_RANK.match(line):
            rank = match.group(1)
        elif (match := _REPORTED_EXIT.match(line)) and rank is not None:
            code = int(match.group(1))
            if code < 0 and -code in signal.valid_signals() and signal.Signals(-code) not in _SECONDARY_SIGNALS:
                killed[rank] = signal.Signals(-code).name
            rank = None
    return sorted(killed.items(), key=lambda item: int(item[0]))


def _boot_time() -> float:
    with open("/proc/stat") as stat:
        return float(next(line.split()[1] for line in stat if line.startswith("btime ")))


def _process_state(pid: int) -> tuple[str, int, float] | None:
    """(state letter, parent PID, start time as time.time()) of a live process from /proc/PID/stat, or None once
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(") ", 1)[1].split()  # after the command name, which may hold spaces
        started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, StopIteration):
        return None
    return fields[0], int(fields[1]), started


def _worker_rank(pid: int) -> str | None:
    """The RANK torchrun gave the worker `pid` (its environment at start), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            variables = dict(v.split(b"=", 1) for v in environ.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    rank = variables.get(b"RANK")
    return rank.decode() if rank is not None else None


class StallWatch:
    """Watches torchrun's workers while it runs (Linux /proc; elsewhere it watches nothing).

    Once a worker has recorded a failure (before that it only reads the launch folder's few error records), it
    learns each worker's rank (to name a worker torchrun's log knows only by PID) and ends with SIGKILL every
    worker that started before that failure and is stopped by a signal (state T): a stopped process acts on no
    other signal, so torchrun's SIGTERM would leave it, and the run, waiting 30 s for torchrun's own SIGKILL.
    Those ranks are `stopped`.
    """

    INTERVAL_S = 0.5

    def __init__(self, torchrun: int, error_dir: Path) -> None:
        self.torchrun, self.error_dir = torchrun, error_dir
        self.ranks: dict[int, str] = {}  # worker PID -> rank
        self.stopped: list[str] = []
        self.done = threading.Event()

    def _workers(self) -> list[int]:
        pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
        return [pid for pid in pids if (_process_state(pid) or ("", 0, 0.0))[1] == self.torchrun]

    def poll(self) -> None:
        try:
            failed = [when for when, _, kind, _ in outcomes(self.error_dir) if kind == "failed"]
        except ValueError:  # a record being written: read it next time
            return
        if not failed:
            return
        for pid in self._workers():
            if pid not in self.ranks and (rank := _worker_rank(pid)) is not None:
                self.ranks[pid] = rank
            state = _process_state(pid)
            # A worker of a later attempt (MAX_RESTARTS) started after the failure: it is not what failed.
            if state and state[0] == "T" and state[2] < max(failed) and pid in self.ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                if self.ranks[pid] not in self.stopped:
                    self.stopped.append(self.ranks[pid])

    def run(self) -> None:
        if not Path("/proc/self/stat").is_file():
            return
        while not self.done.wait(self.INTERVAL_S):
            self.poll()

    def hung(self, report: Path) -> list[str]:
        """Ranks torchrun's log says it had to SIGKILL for still running 30 s after its SIGTERM."""
        pids = _FORCED_KILL.findall(report.read_text(errors="replace"))
        return [self.ranks[int(pid)] for pid in pids if int(pid) in self.ranks]


def stalled_ranks(watch: StallWatch | None, report: Path) -> dict[str, str]:
    """{rank: how it stopped making progress} of the workers `watch` saw stopped or torchrun's log says hung."""
    if watch is None:
        return {}
    stalled = {rank: "its process was stopped by a signal such as SIGSTOP; ended with SIGKILL"
               for rank in watch.stopped}
    for rank in watch.hung(report):
        stalled.setdefault(rank, "it was still running 30 s after torchrun's SIGTERM; ended with SIGKILL")
    return stalled


def keep_report(report: Path, run_dir: Path | None) -> Path:
    """torchrun's log, copied into the run folder when the launch check named one: the launch folder that holds
    the log is removed as the launcher exits, and the last line names the file for the user to read. A run that
    failed before any worker made its folder (a rendezvous that never formed) gets the folder for this log."""
    if run_dir is None:
        return report
    name = f"torchrun-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.log"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copyfile(report, run_dir / name))
    except OSError:  # the folder was writable at the launch check; if no longer, a file of its own outside it
        handle, kept = tempfile.mkstemp(prefix="dtrain-", suffix=f"-{name}")
        os.close(handle)
        return Path(shutil.copyfile(report, kept))


def summary(error_dir: Path, report: Path, run_dir: Path | None, workers: int, signalled: str | None,
            watch: StallWatch | None = None) -> str | None:
    """The launcher's last line when torchrun exited non-zero; None when every local worker finished cleanly
    after a forwarded signal (a preemption: torchrun reports its own signal as a failure)."""
    ended = outcomes(error_dir)
    failures = [(rank, line) for _, rank, kind, line in ended if kind == "failed"]
    if not failures and signalled and len(ended) == workers:
        return None
    kept = keep_report(report, run_dir)
    # A rank killed by a signal (kill -9, the OOM killer) left no line, and its peers then fail with
    # secondary errors ("Connection reset by peer"): it, not the first of them, is what ended the run.
    recorded = {rank for _, rank, _, _ in ended}
    # A stopped or hung worker was killed by the launcher or torchrun after the run had failed: not a cause.
    stalled = {rank: how for rank, how in stalled_ranks(watch, report).items() if rank not in recorded}
    killed = [(rank, name) for rank, name in killed_ranks(report) if rank not in recorded and rank not in stalled]
    if killed:
        rank, name = killed[0]
        return f"error: rank {rank} was killed by {name} (torchrun's report: {kept})"
    if failures:
        rank, line = failures[0]
        if COLLECTIVE_TIMEOUT in line and stalled:
            # The rank that timed out only waited; the one that stopped making progress is what ended the run.
            culprit = min(stalled, key=int)
            return (
                f"error: rank {culprit} stopped making progress ({stalled[culprit]}), and rank {rank} gave up "
                f"waiting for it: {line.removeprefix('error: ')} (torchrun's report: {kept})"
            )
        return f"error: {line.removeprefix('error: ')} (rank {rank} failed first; torchrun's report: {kept})"
    lines = [line.strip() for line in report.read_text(errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else "no output"
    return f"error: torchrun failed before any worker reported an error: {last} (its report: {kept})"


def _workers(command: list[str]) -> int:
    """How many workers torchrun starts on this node (its --nproc_per_node)."""
    for flag in ("--nproc_per_node", "--nproc-per-node"):
        if flag in command:
            return int(command[command.index(flag) + 1])
    return 1


def die_with(parent: int) -> None:
    """Have the kernel send this process SIGKILL when `parent` (its parent) dies, even of SIGKILL. Run in torchrun's
    process between fork and exec (its workers then see torchrun gone and end too: parent_watch.py), and in
    run_train.sh's launch check, so that nothing the user started outlives the process they killed."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl: nothing would deliver the signal
        os._exit(1)


def launch(launch_dir: Path, command: list[str]) -> int:
    """Run torchrun's `command` as the module docstring says; returns the launch's exit status."""
    error_dir = launch_dir / "errors"
    error_dir.mkdir(exist_ok=True)
    report = launch_dir / "torchrun.log"
    env = {**os.environ, ERROR_DIR_ENV: str(error_dir)}
    # PR_SET_PDEATHSIG fires when the thread that forked dies, not the process: fork here, from the main thread,
    # before any reader thread exists (which also keeps preexec_fn safe).
    launcher = os.getpid()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True, preexec_fn=lambda: die_with(launcher))
    watch = StallWatch(process.pid, error_dir)
    watcher = threading.Thread(target=watch.run, daemon=True)
    watcher.start()
    signalled: list[str] = []

    def forward(signum: int, frame) -> None:
        signalled.append(signal.Signals(signum).name)
        process.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    # torchrun tees each worker's stdout and stderr to its own: keep them apart, one reader per stream.
    with open(report, "w", encoding="utf-8") as kept:
        lock = threading.Lock()
        readers = [
            threading.Thread(target=filter_output, args=(kept, stream, out, lock))
            for stream, out in ((process.stdout, sys.stdout), (process.stderr, sys.stderr))
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
    status = process.wait()
    watch.done.set()
    watcher.join()
    if status == 0:
        return 0
    run_dir_file = launch_dir / "run_dir"
    run_dir = Path(run_dir_file.read_text()) if run_dir_file.is_file() else None
    line = summary(error_dir, report, run_dir, _workers(command), signalled[0] if signalled else None, watch)
    if line is None:
        print(f"stopped on {signalled[0]}: every worker exited cleanly (rerun the same command to resume)",
              file=sys.stderr)
        return 0
    print(line, file=sys.stderr)
    return status


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit("usage: python -m dtrain.reliability.launcher LAUNCH_DIR torchrun ARGS...")
    launch_dir = Path(argv[0])
    try:
        return launch(launch_dir, argv[1:])
    finally:
        shutil.rmtree(launch_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
