"""Helpers to run ./run_train.sh as a user would, inside the environment that runs the tests."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Small enough for a few seconds of training on 2 cores, large enough for the loss to fall visibly.
TINY = ["--training.steps", "8", "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--metrics.log_freq", "1"]
# Runs compared at fp32 precision state it: the default compute dtype is bf16 on every layout.
FP32 = ["--training.mixed_precision_param", "float32"]


def user_env(**extra: str) -> dict[str, str]:
    """The test interpreter's environment as the active one, so run_train.sh neither creates nor installs."""
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("DTRAIN_TRACEBACK", None)
    # scripts/test_torch.sh's choice of environment is this interpreter's already; left set, a script run in another
    # checkout (the fake SLURM tests) would look for that checkout's own .venv-torch<version>.
    env.pop("DTRAIN_TORCH_VERSION", None)
    env.update(extra)
    return env


def run_train(*args: str, timeout: int = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["./run_train.sh", *args], cwd=REPO, env=user_env(**env), capture_output=True, text=True, timeout=timeout
    )


def read_metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]



def start_two_process_run(run_dir: Path, checkpoint_interval: int, *args: str, steps: int = 400,
                          **env: str) -> subprocess.Popen:
    """A 2-process run through run_train.sh (long unless `steps` says), returned once it has logged two steps."""
    args = [*TINY, "--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval",
            str(checkpoint_interval), "--job.dump_folder", str(run_dir), *args]
    process = subprocess.Popen(["./run_train.sh", *args], cwd=REPO, env=user_env(NPROC="2", **env), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while not ((run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 2):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    return process


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def worker_rank(pid: int) -> str:
    """The RANK torchrun gave worker `pid`."""
    with open(f"/proc/{pid}/environ", "rb") as environ:
        variables = dict(v.split(b"=", 1) for v in environ.read().split(b"\0") if b"=" in v)
    return variables[b"RANK"].decode()
