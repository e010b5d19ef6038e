"""One attempt of the command the fault soak (scripts/soak.py) kills: the soak's options, the ./run_train.sh
command and environment they give, its start in a session of its own, and what the run logged."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from soak_processes import MARKER

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Options:
    kills: int
    nproc: int
    steps: int
    seed: int
    interval: int
    keep: int
    seq_len: int
    data_workers: int
    attempt_timeout: float
    work_dir: Path


def train_command(o: Options, run_dir: Path) -> list[str]:
    return [
        "./run_train.sh", "--training.steps", str(o.steps), "--training.seq_len", str(o.seq_len),
        "--training.local_batch_size", "4", "--training.mixed_precision_param", "float32",
        "--training.dataloader.num_workers", str(o.data_workers), "--metrics.log_freq", "1",
        "--checkpoint.enable", "--checkpoint.interval", str(o.interval), "--checkpoint.keep_latest_k", str(o.keep),
        "--checkpoint.async_mode", "async", "--job.dump_folder", str(run_dir),
    ]


def run_env(o: Options, tag: str) -> dict[str, str]:
    env = dict(os.environ, NPROC=str(o.nproc), MAX_RESTARTS="0", **{MARKER: tag})
    env["TMPDIR"] = str(o.work_dir / "tmp")  # a killed launcher's launch folder stays behind: keep it in here
    if sys.prefix != sys.base_prefix:  # run in the environment that runs the soak (run_train.sh uses an active one)
        env["VIRTUAL_ENV"] = sys.prefix
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@dataclass
class Attempt:
    """One start of the command: its process, log and what its run folder looked like at the start."""

    process: subprocess.Popen
    tag: str
    log: Path
    label: str
    started: float
    lines_at_start: int

    def ended(self) -> bool:
        return self.process.poll() is not None


def start(o: Options, run_dir: Path, tag: str, log: Path, label: str) -> Attempt:
    lines = len(metric_lines(run_dir))
    with open(log, "w") as out:
        # Its own session: "group" kills then hit this run only, never the soak.
        process = subprocess.Popen(train_command(o, run_dir), cwd=REPO, env=run_env(o, tag), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    return Attempt(process, tag, log, label, time.monotonic(), lines)


def metric_lines(run_dir: Path) -> list[str]:
    """The complete lines of the run's metrics.jsonl (one being written as it is read is left out)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().split("\n")[:-1] if path.exists() else []


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"
