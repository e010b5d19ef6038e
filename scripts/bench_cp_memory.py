"""Benchmark: activation memory per rank under context parallel, at a fixed sequence length.

The same training step (a small Llama 3, one sequence of `--seq_len` tokens, fp32) runs in one process and in
worlds of cp = 2, 4 gloo processes (context parallel only: `data_parallel_shard_degree = 1`, so FSDP shards the
parameters over the cp ranks, as the trainer does). Each rank is built by the trainer's own code (config,
`prepare`, `build_layout`, `build_train_state`, `train_step`) and measures one step, after a first one that
creates the optimizer state, under torch's MemTracker: a dispatch mode that follows every tensor storage as it
is created and freed, so the figures are exact live tensor bytes (no allocator or Python overhead), by kind.

*Activations* are what the forward keeps for the backward (MemTracker's "act") at the end of the model's forward,
where they peak (the backward only frees them). *Kept by attention* is the part of them that the blocks' inner
attentions left alive: their output and what attention saves for its backward. One process keeps the whole
sequence's keys and values repeated for the query heads (SDPA's inputs); under cp on CPU, dtrain's blockwise
attention keeps this rank's queries and output, and the whole sequence's keys and values with their kv heads only
(no mask: parallelize/blockwise_attention.py). Everything else is per token and should fall by exactly 1/cp.
*Total peak* is all live tensors at the step's peak, parameters, gradients and optimizer state (sharded by FSDP
under cp) included. Step times (median of `--steps` untracked steps, each rank with cores / cp threads) are
informative only on a CPU.

    python scripts/bench_cp_memory.py                                      # seq_len 4096: one process, cp=2, cp=4
    python scripts/bench_cp_memory.py --cp 1 2 --seq_len 8192              # a longer sequence
    python scripts/bench_cp_memory.py --cp 1 2 -- --model.args.n_layers 2  # any trainer override after --
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
from torch.distributed._tools.mem_tracker import MemTracker

from dtrain.config import load_config
from dtrain.run.layout import build_layout
from dtrain.run.prepare import prepare
from dtrain.run.train import build_train_state
from dtrain.run.world import STORE_FILE_ENV, init_world
from dtrain.step.train_step import train_step

MIB = 1024**2
# The model: the debug Llama 3 (dim 256, 8 heads, 4 kv heads, byte tokenizer) cut to 4 layers.
MODEL = ["--model.flavor", "debugmodel", "--model.tokenizer", "byte", "--model.args.n_layers", "4"]


def by_kind(snapshot: dict) -> dict[str, int]:
    """MemTracker's one-device snapshot as {kind: bytes} (param, buffer, grad, act, temp, opt, other, total)."""
    (per_kind,) = snapshot.values()
    return {str(kind).split(".")[-1].lower(): value for kind, value in per_kind.items()}


class ActivationProbe:
    """Activation bytes (MemTracker's "act") at the end of the model's forward, and the part of them that the
    inner attentions left alive (each block's first call: the whole sequence's keys and values under cp)."""

    def __init__(self, tracker: MemTracker, model: torch.nn.Module):
        self.tracker = tracker
        self.at_forward_end = 0
        self.before: dict[torch.nn.Module, int] = {}
        self.kept: dict[torch.nn.Module, int] = {}
        self.handles = [model.register_forward_hook(self.forward_end)]
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] == "inner_attention":
                self.handles += [module.register_forward_pre_hook(self.enter), module.register_forward_hook(self.leave)]

    def act(self) -> int:
        return by_kind(self.tracker.get_tracker_snapshot("current"))["act"]

    def forward_end(self, module, args, output) -> None:
        self.at_forward_end = self.act()

    def enter(self, module, args) -> None:
        self.before.setdefault(module, self.act())

    def leave(self, module, args, output) -> None:
        self.kept.setdefault(module, self.act() - self.before[module])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def measure(cp: int, argv: list[str], folder: str, steps: int, timeout_s: int) -> dict:
    """This rank's memory at the peak of one tracked step and its activations at the end of the forward (those
    the attentions kept apart), and the median time of `steps` untracked steps."""
    cfg = load_config([
        *MODEL, *argv, "--parallelism.context_parallel_degree", str(cp),
        "--parallelism.data_parallel_shard_degree", "1", "--training.mixed_precision_param", "float32",
        "--training.skip_memory_check", "--job.dump_folder", os.path.join(folder, "run"),
    ])
    prepared = prepare(cfg)
    with init_world(timeout_s) as world:
        layout = build_layout(cfg, world, prepared.family, prepared.model_args)
        state = build_train_state(cfg, world, layout, prepared.family, prepared.model_args, prepared.tokenizer)
        batch = next(iter(state.dataloader))
        train_step(state, [batch])  # creates the optimizer state; not measured
        tracker = MemTracker()
        tracker.track_external(*state.model_parts, *state.optimizer.optimizers)
        probe = ActivationProbe(tracker, state.model_parts[0])
        with tracker:
            train_step(state, [batch])
        probe.remove()
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            train_step(state, [batch])
            times.append(time.perf_counter() - started)
        return {
            "peak": by_kind(tracker.get_tracker_snapshot("peak")), "act": probe.at_forward_end,
            "attention": sum(probe.kept.values()), "step_s": statistics.median(times),
        }


def worker(rank: int, cp: int, argv: list[str], folder: str, steps: int, timeout_s: int) -> None:
    # The environment torchrun gives a worker; rendezvous through a file (DTRAIN_STORE_FILE), not a port.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cp))
    os.environ[STORE_FILE_ENV] = os.path.join(folder, "store")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))  # the cores shared out between the ranks
    result = measure(cp, argv, folder, steps, timeout_s)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))


def run_world(cp: int, argv: list[str], steps: int, timeout_s: int) -> list[dict]:
    """Spawn `cp` ranks (one process for cp = 1) and return every rank's result; kill them after `timeout_s`."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            worker, args=(cp, argv, folder, steps, timeout_s), nprocs=cp, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        try:
            # join returns False while a rank still runs, and raises (with its traceback) when one failed.
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise SystemExit(f"cp={cp} did not finish in {timeout_s} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(cp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="cp degrees (1: one process)")
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="untracked steps timed per configuration (median)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration, process groups included")
    parser.add_argument("extra", nargs="*", help="trainer overrides passed to every run (after --)")
    args = parser.parse_args()

    argv = ["--training.dataset", "synthetic", "--training.local_batch_size", "1",
            "--training.seq_len", str(args.seq_len), *args.extra]
    results = {cp: run_world(cp, argv, args.steps, args.timeout) for cp in args.cp}
    print(f"seq_len={args.seq_len} batch=1 fp32 overrides={args.extra} torch={torch.__version__}; MiB per rank "
          f"(the rank with the most); ratios to cp={args.cp[0]}")
    print("| cp | activations | ratio | expected | kept by attention | the rest | ratio "
          "| total peak | ratio | params + grads + opt at peak | step (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = {cp: report_row(ranks) for cp, ranks in results.items()}
    base = rows[args.cp[0]]
    for cp, row in rows.items():
        act, attention, total, states, step_s = row
        print(f"| {cp} | {act / MIB:.1f} | {act / base[0]:.3f} | {args.cp[0] / cp:.3f} | {attention / MIB:.1f} "
              f"| {(act - attention) / MIB:.1f} | {(act - attention) / (base[0] - base[1]):.3f} "
              f"| {total / MIB:.1f} | {total / base[2]:.3f} | {states / MIB:.1f} | {step_s:.2f} |")
    spread = max(max(r["act"] for r in ranks) - min(r["act"] for r in ranks) for ranks in results.values())
    print(f"activations differ between the ranks of a world by at most {spread / MIB:.2f} MiB")


def report_row(ranks: list[dict]) -> tuple[int, int, int, int, float]:
    """Activations, those kept by attention, total peak, states at the peak (the rank with the most of each) and
    the median step time over the ranks."""
    return (
        max(r["act"] for r in ranks),
        max(r["attention"] for r in ranks),
        max(r["peak"]["total"] for r in ranks),
        max(r["peak"]["param"] + r["peak"]["grad"] + r["peak"]["opt"] for r in ranks),
        statistics.median(r["step_s"] for r in ranks),
    )


if __name__ == "__main__":
    main()
