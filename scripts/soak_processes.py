"""The processes of one soak attempt (scripts/soak.py): found by a marker in their environment, so that orphans
are found too, named by their role, and killed."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

# Set in the environment of every attempt (one value per attempt): each of its processes inherits it, which is how
# the soak finds them all, including one that outlived its parent.
MARKER = "DTRAIN_SOAK_ATTEMPT"
# Once the process the user started has ended, the rest of its run must be gone within this many seconds (workers
# poll for their launcher once a second, data loader workers for their rank ten times a second).
GRACE_S = 10.0


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    argv: tuple[str, ...]
    rank: str | None

    @property
    def cmdline(self) -> str:
        return " ".join(self.argv)

    @property
    def program(self) -> str:
        """What it runs: a Python module (`-m`) or script, else the executable (torchrun's own argv names
        dtrain.main too, so its arguments are not searched)."""
        name = Path(self.argv[0]).name if self.argv else ""
        if not name.startswith("python"):
            return name
        rest = list(self.argv[1:])
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest.pop(0)
        if rest[:1] == ["-m"]:
            return rest[1] if len(rest) > 1 else name
        return Path(rest[0]).name if rest else name


def processes(tag: str) -> list[Proc]:
    """The live processes whose environment carries MARKER=tag (zombies have no environment left to read)."""
    wanted = f"{MARKER}={tag}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes().split(b"\0")
            if wanted not in environ:
                continue
            stat = Path(entry.path, "stat").read_text()
            argv = Path(entry.path, "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:  # gone meanwhile, or another user's
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), None)
        found.append(Proc(int(entry.name), ppid, tuple(argv), rank))
    return found


def roles(procs: list[Proc], user_pid: int) -> dict[int, str]:
    """What each process is: launcher, torchrun, rank N, data worker of rank N, launch check, or other."""
    by_pid = {p.pid: p for p in procs}
    trainer = {p.pid for p in procs if p.program == "dtrain.main" and "--launcher_check" not in p.argv}
    named = {}
    for p in procs:
        if p.pid == user_pid:
            named[p.pid] = "launcher"
        elif p.program == "torchrun":
            named[p.pid] = "torchrun"
        elif p.ppid in trainer and p.pid in trainer:  # forked by a rank: a data loader worker
            parent = by_pid[p.ppid]
            named[p.pid] = f"data worker of {'rank ' + parent.rank if parent.rank else 'the trainer'}"
        elif p.pid in trainer:
            named[p.pid] = f"rank {p.rank}"
        elif "--launcher_check" in p.argv:
            named[p.pid] = "launch check"
        else:
            named[p.pid] = "other"
    return named


def sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_everything(tag: str) -> None:
    """Clean-up: SIGKILL every process of the attempt (also what the soak does on its way out)."""
    for p in processes(tag):
        sigkill(p.pid)


def wait_until_gone(tag: str) -> list[str]:
    """Wait up to GRACE_S for every process of the attempt to end; returns those still alive (killed then)."""
    deadline = time.monotonic() + GRACE_S
    while (left := processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    described = [f"pid {p.pid} ({p.cmdline[:120]})" for p in left]
    kill_everything(tag)
    return described
