"""Benchmark: one MoE layer's forward and backward with the experts as grouped GEMMs vs as a per-expert loop.

``GroupedExperts`` runs ``torch._grouped_mm`` where it can (bf16 on Hopper or newer GPUs; on the CPU bf16, and
float32/fp16 outside torch.compile) and falls back to a Python loop of one SwiGLU per expert (which reads the counts
on the host) elsewhere. This script forces each path on identical copies of one layer, same input, and times
rounds of ``--steps`` forward+backward passes, the paths taking turns; the report is the median tokens/s of each
path and the ratio grouped / loop, for a few shapes: coarse experts (few, wide) to fine-grained ones (many, narrow,
DeepSeek-like), where the loop's per-expert overhead weighs most.

    python scripts/bench_moe.py                    # float32 and bfloat16, default shapes, CPU
    python scripts/bench_moe.py --dtypes bfloat16 --tokens 8192
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import copy
import statistics

import torch

from bench_step import alternating_rounds
from dtrain.models.moe import MoE, MoEArgs, _experts_grouped_mm, _experts_loop, _grouped_mm_runs

# (name, dim, MoEArgs): CPU-sized versions of the usual shapes, from 8 wide experts to 64 narrow ones.
SHAPES = [
    ("coarse: dim 512, 8 experts × 1024, top-2", 512, MoEArgs(num_experts=8, top_k=2, hidden_dim=1024)),
    ("qwen3-like: dim 512, 32 × 256, top-4", 512, MoEArgs(num_experts=32, top_k=4, hidden_dim=256, route_norm=True)),
    ("deepseek-like: dim 512, 64 × 128, top-6, 1 shared", 512,
     MoEArgs(num_experts=64, top_k=6, hidden_dim=128, num_shared_experts=1, score_func="sigmoid", route_norm=True,
             num_expert_groups=8, num_limited_groups=4, load_balance_bias=True)),
]


def force_experts_path(moe: MoE, path) -> MoE:
    """Make ``moe.experts`` always take ``path`` (the grouped-GEMM or the loop function)."""
    experts = moe.experts

    def forward(x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return path(x, num_tokens_per_expert, *(w.to(x.dtype) for w in (experts.w1, experts.w2, experts.w3)))

    experts.forward = forward
    return moe


def forward_backward_loop(moe: MoE, x: torch.Tensor):
    def run(steps: int) -> torch.Tensor:
        for _ in range(steps):
            moe.zero_grad(set_to_none=True)
            out = moe(x)
            out.float().square().mean().backward()
        return out.detach().float().sum()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per forward (batch × seq_len)")
    parser.add_argument("--steps", type=int, default=2, help="forward+backward passes per timed round")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per path (alternating)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    print(f"device={device} tokens={args.tokens} steps={args.steps} rounds={args.rounds} torch={torch.__version__} "
          f"threads={torch.get_num_threads()}")
    print("| shape | dtype | loop tokens/s | grouped_mm tokens/s | grouped / loop |")
    print("|---|---|---|---|---|")
    for name, dim, moe_args in SHAPES:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            torch.manual_seed(0)
            reference = MoE(moe_args, dim).to(device)
            reference.init_weights(init_std=0.02, out_std=0.02)
            reference.to(dtype)
            x = torch.randn(args.tokens, 1, dim, device=device, dtype=dtype)
            if not _grouped_mm_runs(x.view(-1, dim), moe_args.hidden_dim):
                print(f"| {name} | {dtype_name} | - | torch._grouped_mm does not run here | - |")
                continue
            loops = {
                path_name: forward_backward_loop(force_experts_path(copy.deepcopy(reference), path), x)
                for path_name, path in (("loop", _experts_loop), ("grouped", _experts_grouped_mm))
            }
            times = alternating_rounds(loops, args.rounds, args.steps, device, warmup_steps=1)
            tps = {path_name: args.tokens * args.steps / statistics.median(t) for path_name, t in times.items()}
            print(f"| {name} | {dtype_name} | {tps['loop']:.0f} | {tps['grouped']:.0f} | "
                  f"{tps['grouped'] / tps['loop']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
