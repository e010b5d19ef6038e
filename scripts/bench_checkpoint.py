"""How long a checkpoint save blocks the training loop: synchronous vs async (vs async with pinned memory on CUDA).

Builds a Llama 3 model of the given size with its AdamW state (one real training step), then saves the full
TrainState through CheckpointManager several times per mode, as the trainer does after a step, and runs the next
step. Blocked time is how long the loop waited for the checkpoint: the whole save when synchronous; when async,
the call plus any wait for the background copy before the next optimizer step (CheckpointManager.last_blocked_s).
The next step's time beside a quiet step's shows what the background work costs the step otherwise (the copy and
the writer share the CPU with it). Then the cost of checksums: the same state saved by DCP's plain writer and by
dtrain's checksumming one, and loaded by a reader that verifies every item against them and by one that does not.
Prints Markdown tables for docs/benchmarks.md.

    python scripts/bench_checkpoint.py                        # ~60M parameters, 3 rounds per mode
    python scripts/bench_checkpoint.py --dim 1024 --layers 16 --rounds 5
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import copy
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dtrain.checkpoint import CheckpointManager, dcp_io
from dtrain.checkpoint.folders import CommitRecord, commit
from dtrain.checkpoint.safe_reading import SafeFileSystemReader, SafeLoadPlanner
from dtrain.config.schema import JobConfig
from dtrain.data import build_dataloader, build_tokenizer
from dtrain.models import count_params
from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.step.executor import LocalExecutor
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.train_step import StepLoss, train_step


@dataclass
class Timing:
    mode: str
    blocked_s: list[float] = field(default_factory=list)
    written_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    quiet_step_s: list[float] = field(default_factory=list)


def build_state(args: Llama3Args, cfg: JobConfig, device: torch.device) -> TrainState:
    with torch.device(device):
        model = Transformer(args)
    optimizer = build_optimizers([model], cfg.optimizer, device)
    state = TrainState(
        model_parts=[model],
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_scheduler),
        dataloader=build_dataloader(cfg.training, build_tokenizer(cfg.model), 0, 1, seed=cfg.debug.seed),
        setup=StepSetup(LocalExecutor(StepLoss()), seed=cfg.debug.seed, max_norm=cfg.training.max_norm),
    )
    timed_step(state)  # creates the optimizer state, so the checkpoint has its real size
    return state


def timed_step(state: TrainState) -> float:
    device = state.model_parts[0].output.weight.device
    batch = {k: v.to(device) for k, v in next(state.dataloader).items()}
    started = time.perf_counter()
    train_step(state, [batch])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def time_modes(state: TrainState, cfg: JobConfig, modes: list[str], rounds: int, run_dir: Path) -> list[Timing]:
    """Per round and mode: save after a step as the trainer does, run the next step, wait for the commit, run a
    quiet step. Modes take turns within each round, so that they share whatever else the machine is doing."""
    managers, timings = {}, {}
    for mode in modes:
        mode_cfg = copy.deepcopy(cfg)
        mode_cfg.checkpoint.async_mode = mode
        managers[mode] = CheckpointManager(
            mode_cfg.checkpoint, run_dir / mode, 0, 1, state, training=mode_cfg.training,
            parallelism=mode_cfg.parallelism, model=mode_cfg.model, optimizer=mode_cfg.optimizer,
        )
        timings[mode] = Timing(mode)
    for round_ in range(rounds + 1):  # the first round allocates the staging buffers: not timed
        for mode, manager in managers.items():
            started = time.perf_counter()
            manager.save(state.step)
            returned = time.perf_counter()
            step_s = timed_step(state)  # an async copy still running is waited for before this step's optimizer
            blocked = manager.last_blocked_s
            manager.wait()
            # Wall clock until the checkpoint is committed: the call itself when synchronous; when async, the
            # background write, which overlaps the step that ran meanwhile.
            written = (returned if mode == "disabled" else time.perf_counter()) - started
            quiet_step_s = timed_step(state)
            if round_:
                timing = timings[mode]
                timing.blocked_s.append(blocked)
                timing.written_s.append(written)
                timing.step_s.append(step_s)
                timing.quiet_step_s.append(quiet_step_s)
    for manager in managers.values():
        manager.close()
    return [timings[mode] for mode in modes]


def time_checksums(state: TrainState, rounds: int, run_dir: Path) -> dict[str, list[float]]:
    """Seconds per save and load of the full state, without and with checksums, taking turns within each round."""
    times: dict[str, list[float]] = {"save": [], "save, checksummed": [], "load": [], "load, verified": []}
    for round_ in range(rounds + 1):  # the first round warms the page cache and the allocator: not timed
        plain, checked = run_dir / f"plain-{round_}", run_dir / f"checked-{round_}"
        started = time.perf_counter()
        dcp.save(state.state_dict(), checkpoint_id=str(plain), no_dist=True)
        saved_plain = time.perf_counter()
        dcp_io.save(state.state_dict(), checked.with_name(checked.name + ".partial"))
        commit(checked.with_name(checked.name + ".partial"), checked, CommitRecord(step=state.step, kind="full"))
        saved_checked = time.perf_counter()
        dcp.load(state.state_dict(), storage_reader=SafeFileSystemReader(str(plain)), planner=SafeLoadPlanner(),
                 no_dist=True)
        loaded_plain = time.perf_counter()
        dcp_io.load(state.state_dict(), checked)
        loaded_checked = time.perf_counter()
        if round_:
            times["save"].append(saved_plain - started)
            times["save, checksummed"].append(saved_checked - saved_plain)
            times["load"].append(loaded_plain - saved_checked)
            times["load, verified"].append(loaded_checked - loaded_plain)
        shutil.rmtree(plain)
        shutil.rmtree(checked)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    opts = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = Llama3Args(dim=opts.dim, n_layers=opts.layers, n_heads=8, n_kv_heads=4, vocab_size=opts.vocab,
                      multiple_of=256, ffn_dim_multiplier=None, max_seq_len=64)
    cfg = JobConfig()
    cfg.model.tokenizer = "byte"
    cfg.training.dataset, cfg.training.seq_len, cfg.training.local_batch_size = "synthetic", 64, 2
    cfg.checkpoint.enable, cfg.checkpoint.keep_latest_k = True, 1
    state = build_state(args, cfg, device)
    modes = ["disabled", "async"] + (["async_with_pinned_mem"] if device.type == "cuda" else [])
    run_dir = Path(opts.folder or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    try:
        timings = time_modes(state, cfg, modes, opts.rounds, run_dir)
        size_mb = sum(p.stat().st_size for p in (run_dir / "disabled").rglob("*") if p.is_file()) / 1e6
        checksum_times = time_checksums(state, opts.rounds, run_dir)
    finally:
        if opts.folder is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    sync_blocked = statistics.median(timings[0].blocked_s)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or 'cpu'} CPU"
    print(f"{count_params(state.model_parts[0]) / 1e6:.1f}M parameters, full state {size_mb:.0f} MB on disk, "
          f"{device.type} ({name}), torch {torch.__version__}, median of {opts.rounds} saves")
    print("| async_mode | training blocked (s) | vs synchronous | next step, save in flight / quiet (s) "
          "| until committed (s) |")
    print("|---|---|---|---|---|")
    for t in timings:
        blocked = statistics.median(t.blocked_s)
        print(f"| {t.mode} | {blocked:.3f} | {100 * blocked / sync_blocked:.0f}% | "
              f"{statistics.median(t.step_s):.2f} / {statistics.median(t.quiet_step_s):.2f} | "
              f"{statistics.median(t.written_s):.3f} |")

    print("\n| | without checksums (s) | with checksums (s) | cost |")
    print("|---|---|---|---|")
    for what, plain, checked in (
        ("save (sync, full state)", "save", "save, checksummed"), ("load (full state)", "load", "load, verified")
    ):
        plain_s, checked_s = statistics.median(checksum_times[plain]), statistics.median(checksum_times[checked])
        print(f"| {what} | {plain_s:.3f} | {checked_s:.3f} | {100 * (checked_s / plain_s - 1):+.0f}% |")


if __name__ == "__main__":
    main()
