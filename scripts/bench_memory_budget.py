"""Benchmark: activations kept for backward, and step time, against `activation_checkpoint.memory_budget`.

The trainer's own step (config, `prepare`, `build_layout`, `build_train_state`, `train_step`; a small Llama 3, one
process, fp32, compiled blocks) runs once per configuration, each in a fresh process so that every one compiles
from scratch under its own budget (torch reads the budget when a block compiles). *Kept* is what autograd saves
for backward during one step's forward, counted through `torch.autograd.graph.saved_tensors_hooks` once per
storage: under a memory budget that is what the compiled blocks chose to keep, plus what the uncompiled parts
(embedding, head, loss) keep whatever the budget. No AC and full AC (both compiled) frame the range. Step times
(median of `--steps` steps after the compiling one) are informative only on a CPU.

    python scripts/bench_memory_budget.py                              # budgets 0, 0.25, 0.5, 0.75, 1, seq 2048
    python scripts/bench_memory_budget.py --budgets 0 1 -- --training.seq_len 4096   # trainer overrides after --
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dtrain.config import load_config
from dtrain.run.layout import build_layout
from dtrain.run.prepare import prepare
from dtrain.run.train import build_train_state
from dtrain.run.world import STORE_FILE_ENV, init_world
from dtrain.step.train_step import train_step

MIB = 1024**2
# The debug Llama 3 (dim 256, 8 heads, 4 kv heads, byte tokenizer) cut to 4 layers, compiled per block.
MODEL = [
    "--model.flavor", "debugmodel", "--model.tokenizer", "byte", "--model.args.n_layers", "4",
    "--compile.enable", "--compile.components", "model", "--training.mixed_precision_param", "float32",
    "--training.dataset", "synthetic", "--training.local_batch_size", "1", "--training.skip_memory_check",
]


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while it is active."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.keep, lambda tensor: tensor)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def measure(ac: list[str], argv: list[str], folder: str, steps: int, timeout_s: int) -> dict:
    cfg = load_config([*MODEL, *ac, *argv, "--job.dump_folder", os.path.join(folder, "run")])
    prepared = prepare(cfg)
    with init_world(timeout_s) as world:
        layout = build_layout(cfg, world, prepared.family, prepared.model_args)
        state = build_train_state(cfg, world, layout, prepared.family, prepared.model_args, prepared.tokenizer)
        batch = next(iter(state.dataloader))
        started = time.perf_counter()
        train_step(state, [batch])  # compiles, and creates the optimizer state
        first_s = time.perf_counter() - started
        saved = SavedBytes()
        with saved.hooks():
            train_step(state, [batch])
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            train_step(state, [batch])
            times.append(time.perf_counter() - started)
        return {"kept": saved.total, "first_s": first_s, "step_s": statistics.median(times)}


def worker(rank: int, ac: list[str], argv: list[str], folder: str, steps: int, timeout_s: int) -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ[STORE_FILE_ENV] = os.path.join(folder, "store")
    Path(folder, "result.json").write_text(json.dumps(measure(ac, argv, folder, steps, timeout_s)))


def run(ac: list[str], argv: list[str], steps: int, timeout_s: int) -> dict:
    """One configuration in a fresh process; killed after `timeout_s`."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            worker, args=(ac, argv, folder, steps, timeout_s), nprocs=1, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{ac} did not finish in {timeout_s} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return json.loads(Path(folder, "result.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--steps", type=int, default=3, help="steps timed per configuration (median)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    parser.add_argument("extra", nargs="*", help="trainer overrides passed to every run (after --)")
    args = parser.parse_args()
    argv = args.extra or ["--training.seq_len", "2048"]

    configurations = {"no AC": ["--activation_checkpoint.mode", "none"]}
    for budget in args.budgets:
        configurations[f"memory_budget {budget:g}"] = [
            "--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", str(budget)
        ]
    configurations["full AC"] = ["--activation_checkpoint.mode", "full"]
    results = {name: run(ac, argv, args.steps, args.timeout) for name, ac in configurations.items()}

    base = results["no AC"]
    print(f"overrides={argv} torch={torch.__version__}; kept for backward per step, ratios to no AC")
    print("| AC | kept (MiB) | ratio | first step (s) | step (s) | ratio |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['kept'] / MIB:.1f} | {r['kept'] / base['kept']:.3f} | {r['first_s']:.1f} "
              f"| {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} |")


if __name__ == "__main__":
    main()
