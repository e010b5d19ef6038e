"""Benchmark: dtrain's train_step against a minimal hand-written PyTorch loop, side by side in one process.

Both loops train identical copies of the same model (same init) on the same batch with the same optimizer,
schedule and clipping; rounds alternate between them so that machine noise hits both alike. The report is the
ratio of tokens/s, dtrain over bare (target: >= 0.98 on CPU):

    python scripts/bench_step.py                          # debug model, CPU
    python scripts/bench_step.py --flavor 1B --device cuda --seq_len 2048 --batch 4
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import copy
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.parallelize import get_family
from dtrain.step.executor import LocalExecutor
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizer, build_optimizers
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.train_step import StepLoss, train_step


class FixedBatchData:
    """The benchmark reuses one batch; this stands in for the dataloader part of the state."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_loop(model, batch, steps, max_norm, opt_cfg, sched_cfg, device):
    """The loop a PyTorch user writes by hand: forward, mean loss, backward, clip, step."""
    optimizer = build_optimizer([model], opt_cfg, device)
    scheduler = build_lr_scheduler(optimizer, 10**6, sched_cfg)
    inputs, labels = batch["input_ids"], batch["labels"]

    def run(n):
        for _ in range(n):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        return loss.detach()

    return run


def dtrain_loop(model, batch, steps, max_norm, opt_cfg, sched_cfg, device):
    optimizer = build_optimizers([model], opt_cfg, device)
    state = TrainState(
        model_parts=[model],
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(optimizer, 10**6, sched_cfg),
        dataloader=FixedBatchData(),
        setup=StepSetup(LocalExecutor(StepLoss()), seed=0, max_norm=max_norm),
    )

    def run(n):
        for _ in range(n):
            metrics = train_step(state, [batch])
        return metrics["loss"]

    return run


def timed(run, steps, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    run(steps).item()  # one host sync at the end, as in a real loop between log intervals
    synchronize(device)
    return time.perf_counter() - start


def alternating_rounds(loops: dict, rounds: int, steps: int, device: torch.device, warmup_steps: int) -> dict:
    """Seconds of each of `rounds` rounds of `steps` steps per loop, the loops taking turns, after a warm-up."""
    for run in loops.values():  # warm up allocators, kernels and optimizer state
        timed(run, warmup_steps, device)
    times = {name: [] for name in loops}
    for round_index in range(rounds):
        # Alternate which loop goes first, so that neither always inherits the other's cache or clock state.
        order = list(loops) if round_index % 2 == 0 else list(reversed(loops))
        for name in order:
            times[name].append(timed(loops[name], steps, device))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3")
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--vocab_size", type=int, default=320)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per loop (alternating)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    device = torch.device(args.device)
    family = get_family(args.model).model
    model_args = replace(family.flavors[args.flavor], vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    torch.manual_seed(0)
    with torch.device("meta"):
        reference = family.model_cls(model_args)
    reference.to_empty(device=device)
    reference.init_weights()
    reference.to(getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (args.batch, args.seq_len + 1), generator=g).to(device)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    opt_cfg, sched_cfg = Optimizer(lr=1e-4), LRScheduler(warmup_steps=10)

    loops = {
        "bare": bare_loop(copy.deepcopy(reference), batch, args.steps, 1.0, opt_cfg, sched_cfg, device),
        "dtrain": dtrain_loop(copy.deepcopy(reference), batch, args.steps, 1.0, opt_cfg, sched_cfg, device),
    }
    times = alternating_rounds(loops, args.rounds, args.steps, device, warmup_steps=2)
    tokens_per_round = args.batch * args.seq_len * args.steps
    # The fastest round is the least disturbed by other work on the machine; the median is shown beside it.
    tps = {name: tokens_per_round / min(t) for name, t in times.items()}
    median_tps = {name: tokens_per_round / statistics.median(t) for name, t in times.items()}
    print(f"device={device} model={args.model}/{args.flavor} batch={args.batch} seq_len={args.seq_len} "
          f"dtype={args.dtype} steps/round={args.steps} rounds={args.rounds} torch={torch.__version__}")
    for name, value in tps.items():
        print(f"{name:>7}: {value:12.1f} tokens/s best round, {median_tps[name]:12.1f} median of {args.rounds}")
    print(f"ratio dtrain/bare: {tps['dtrain'] / tps['bare']:.3f} (best rounds), "
          f"{median_tps['dtrain'] / median_tps['bare']:.3f} (medians)")


if __name__ == "__main__":
    main()
