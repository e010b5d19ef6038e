"""Benchmark: the trainer's step in each compute dtype (training.mixed_precision_param), side by side in one process.

Identical copies of one model (fp32 parameters, same init), each parallelized for one process as the trainer does
(so bf16 means the forward under autocast, with fp32 master weights and optimizer), train on the same batch; rounds
alternate between them so that machine noise hits all alike. The report is tokens/s and the ratio to fp32: what
chooses the default compute dtype of a CPU run (bf16 wins where the CPU has bf16 units, e.g. AVX512-BF16 or AMX).

    python scripts/bench_precision.py                                        # debug model, CPU
    python scripts/bench_precision.py --dim 1024 --n_layers 4 --seq_len 512  # larger matmuls
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import copy
import statistics
from dataclasses import replace

import torch

from bench_step import alternating_rounds, dtrain_loop
from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.parallelize import ParallelDims, ParallelizeOptions, get_family


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--dim", type=int, help="override the flavor's model dim (heads keep their count)")
    parser.add_argument("--n_layers", type=int)
    parser.add_argument("--vocab_size", type=int, default=320)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per dtype (alternating)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    spec = get_family(args.model)
    overrides = {key: value for key, value in (("dim", args.dim), ("n_layers", args.n_layers)) if value}
    model_args = replace(
        spec.model.flavors[args.flavor], vocab_size=args.vocab_size, max_seq_len=args.seq_len, **overrides
    )
    torch.manual_seed(0)
    reference = spec.model.model_cls(model_args).to(device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (args.batch, args.seq_len + 1), generator=g).to(device)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    opt_cfg, sched_cfg = Optimizer(lr=1e-4), LRScheduler(warmup_steps=10)

    loops = {}
    for dtype in args.dtypes:
        model = copy.deepcopy(reference)
        options = ParallelizeOptions(device_type=device.type, param_dtype=dtype)
        spec.parallelize(model, None, ParallelDims(1), options)
        loops[dtype] = dtrain_loop(model, batch, args.steps, 1.0, opt_cfg, sched_cfg, device)
    times = alternating_rounds(loops, args.rounds, args.steps, device, warmup_steps=1)

    tokens_per_round = args.batch * args.seq_len * args.steps
    median_tps = {name: tokens_per_round / statistics.median(t) for name, t in times.items()}
    base = median_tps[args.dtypes[0]]
    print(f"device={device} model={args.model}/{args.flavor} dim={model_args.dim} n_layers={model_args.n_layers} "
          f"batch={args.batch} seq_len={args.seq_len} rounds={args.rounds} torch={torch.__version__}")
    print(f"| compute dtype | tokens/s (median) | ratio to {args.dtypes[0]} |")
    print("|---|---|---|")
    for name, value in median_tps.items():
        print(f"| {name} | {value:.1f} | {value / base:.2f} |")


if __name__ == "__main__":
    main()
