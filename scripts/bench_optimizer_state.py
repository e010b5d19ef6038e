"""Benchmark: optimizer-state bytes of AdamW and of torchao's low-bit AdamWs, on the same model, side by side.

For each optimizer the trainer's own code (config, `prepare`, `build_layout`, `build_train_state`, `train_step`)
builds the model in one process and runs one training step, which creates the optimizer state; then the bytes that
state really holds are counted: for a quantized moment its codes, block scales and lookup table (torchao's tensors
present themselves as float32 tensors of the parameter's shape, so `numel() * element_size()` would count them at
float32 size). *Estimate* is what the memory pre-flight check assumes for the same model
(`dtrain.step.optimizer.moment_bytes` plus the step counts). The first step compiles torchao's step (`torch.compile`, once
per parameter shape), so its time is mostly compilation; a second step is timed too.

    python scripts/bench_optimizer_state.py                          # the debug Llama 3 scaled to ~85M parameters
    python scripts/bench_optimizer_state.py --optimizers AdamW AdamW8bit -- --model.flavor debugmodel
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import tempfile
import time

import torch

from dtrain.config import load_config
from dtrain.config.low_bit_optim import low_bit_format
from dtrain.parallelize import local_shard
from dtrain.run.layout import build_layout
from dtrain.run.memory_preflight import STEP_BYTES
from dtrain.run.prepare import prepare
from dtrain.run.train import build_train_state
from dtrain.run.world import init_world
from dtrain.step.optimizer import moment_bytes
from dtrain.step.train_step import train_step

MIB = 1024**2
# The debug Llama 3 (byte tokenizer, vocab 320) widened and deepened to GPT-2-small's shape: ~85M parameters.
MODEL = ["--model.flavor", "debugmodel", "--model.tokenizer", "byte", "--model.args.dim", "768",
         "--model.args.n_layers", "12", "--model.args.n_heads", "12", "--model.args.n_kv_heads", "12"]


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` holds: a torchao state's inner tensors (codes, scales, table), else its elements."""
    tensor = local_shard(tensor)
    if hasattr(tensor, "__tensor_flatten__"):
        return sum(stored_bytes(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
    return tensor.numel() * tensor.element_size()


def measure(name: str, argv: list[str], folder: str) -> dict:
    """One process: build the state with optimizer.name = `name`, step twice, count its optimizer state."""
    cfg = load_config([*MODEL, *argv, "--optimizer.name", name, "--job.dump_folder", folder])
    prepared = prepare(cfg)
    with init_world() as world:
        layout = build_layout(cfg, world, prepared.family, prepared.model_args)
        state = build_train_state(cfg, world, layout, prepared.family, prepared.model_args, prepared.tokenizer)
        times = []
        for _ in range(2):
            batch = next(state.dataloader)
            started = time.perf_counter()
            train_step(state, [batch])
            times.append(time.perf_counter() - started)
        params = [p for p in state.parameters if p.requires_grad]
        fmt = low_bit_format(name)
        return {
            "elements": sum(local_shard(p).numel() for p in params),
            "state": sum(stored_bytes(v) for s in state.optimizer.state.values() for v in s.values()),
            "estimate": sum(moment_bytes(name, p) for p in params) + STEP_BYTES * len(params),
            "quantized": sum(
                local_shard(p).numel() for p in params
                if fmt is not None and type(local_shard(state.optimizer.state[p]["exp_avg"])) is not torch.Tensor
            ),
            "first_step_s": times[0],
            "second_step_s": times[1],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", nargs="+", default=["AdamW", "AdamW8bit", "AdamW4bit", "AdamWFp8"],
                        help="optimizer.name values; the first is the baseline of the ratios")
    parser.add_argument("extra", nargs="*", help="trainer overrides passed to every run (after --)")
    args = parser.parse_args()

    argv = ["--training.dataset", "synthetic", "--training.local_batch_size", "1", "--training.seq_len", "64",
            "--training.mixed_precision_param", "float32", *args.extra]
    with tempfile.TemporaryDirectory() as folder:
        results = {name: measure(name, argv, f"{folder}/{name}") for name in args.optimizers}
    base = results[args.optimizers[0]]
    print(f"{base['elements'] / 1e6:.1f}M trainable parameters, overrides={args.extra}, torch={torch.__version__}; "
          f"ratios to {args.optimizers[0]}")
    print("| optimizer | state (MiB) | bytes per parameter | ratio | estimate (MiB) | parameters quantized "
          "| first step (s) | second step (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['state'] / MIB:.2f} | {r['state'] / r['elements']:.3f} "
              f"| {r['state'] / base['state']:.3f} | {r['estimate'] / MIB:.2f} | {r['quantized'] / r['elements']:.1%} "
              f"| {r['first_step_s']:.2f} | {r['second_step_s']:.2f} |")


if __name__ == "__main__":
    main()
