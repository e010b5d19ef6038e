"""Workers end when their launcher dies, and take the dead launcher's private launch folder with them.

torchrun starts each worker in its own session, so when torchrun itself is killed (kill -9, an OOM kill) nothing
reaches the workers: they keep training and writing checkpoints into the run folder, and a relaunch races them.
A daemon thread in each worker watches its parent process and, once the worker has been re-parented (the launcher
is gone), ends the worker at once. Checkpoints are atomic (a save commits by a rename once every rank is done),
so dying mid-save leaves only a `step-N.partial` folder that is never loaded and is removed at the next start.

run_train.sh's launcher (dtrain/reliability/launcher.py) removes its launch folder in $TMPDIR (stores, error
lines) as it ends, but a launcher killed by SIGKILL cannot: the kernel then kills torchrun (PR_SET_PDEATHSIG), and
the workers, the last processes of the run, remove the folder (named in DTRAIN_LAUNCH_DIR) on their way out. They
do so only once the launcher (DTRAIN_LAUNCHER_PID) is itself gone: a live launcher (only torchrun was killed)
still reads the folder to name the failure, and removes it after.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

POLL_SECONDS = 1.0
LAUNCH_DIR_ENV = "DTRAIN_LAUNCH_DIR"
LAUNCHER_PID_ENV = "DTRAIN_LAUNCHER_PID"


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field), which tells it from a
    later process given the same pid; None when it has ended (a zombie included) or /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after "pid (name)": the name may hold spaces
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def exit_when_orphaned(poll_seconds: float = POLL_SECONDS) -> threading.Thread:
    """Start the watch for this process's current parent; returns the (daemon) thread."""
    parent = os.getppid()
    launch_dir = os.environ.get(LAUNCH_DIR_ENV, "")
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV, "")
    launcher = int(launcher_pid) if launcher_pid.isdigit() else None
    launcher_start = process_start(launcher) if launcher is not None else None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        print(f"dtrain: the launcher (pid {parent}) is gone; this worker (pid {os.getpid()}) exits now",
              file=sys.stderr, flush=True)
        if launch_dir and launcher_start is not None and process_start(launcher) != launcher_start:
            # Every worker may get here at once: whichever removes a file first wins, the others ignore it.
            shutil.rmtree(launch_dir, ignore_errors=True)
        # os._exit: no cleanup that could wait on peers that are gone too.
        os._exit(1)

    thread = threading.Thread(target=watch, name="dtrain-launcher-watch", daemon=True)
    thread.start()
    return thread
