"""Benchmark: data loading per rank against training, for text read and tokenized in the loader and for a
pre-tokenized dataset, at simulated data-parallel sizes, side by side in one run.

A rank of a dp-way run takes `batch` sequences of each global batch of dp x batch. With a text source it packs the
whole global batch (tokenizing it) and keeps its slice; with a pre-tokenized dataset it reads its own windows
only. The benchmark times rank 0's loading (in the calling thread, no background: the work itself) for each
tokenizer, dataset kind and dp, and sets it against what one rank trains: the debug model's train_step measured
here, and torchtitan's published Llama 3 8B figure on H100 (5,762 tokens/s per GPU, eager bf16 FSDP). Data: the
built-in corpus (the stdlib's .py files), tokenized by bytes and by a byte-level BPE trained here (no download);
the one-off tokenization into token shards is timed too.

    python scripts/bench_data_scale.py                                  # 8 x 2048 per rank, dp 1 and 64
    python scripts/bench_data_scale.py --dps 1,8,64,512 --tokenizers byte
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import os
import platform
import shutil
import sys
import time
from dataclasses import replace

import torch
from bench_dataloader import train_bpe  # scripts/ is on sys.path when this script runs

from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.data import ByteTokenizer, DataLoader, Tokenizer
from dtrain.data.corpus_input import open_input
from dtrain.data.samples import TokenSamples
from dtrain.data.sources import BuiltinSource
from dtrain.data.token_shards import TokenShards
from dtrain.data.tokenize_corpus import tokenize_corpus
from dtrain.parallelize import get_family
from dtrain.step.executor import LocalExecutor
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.train_step import StepLoss, train_step

# torchtitan's Llama 3 8B on 8 H100s, eager bf16 FSDP (its docs/performance.md): what one GPU rank consumes.
H100_LLAMA3_8B_TOKENS_PER_S = 5762


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_len", type=int, default=2048, help="Tokens per sequence.")
    parser.add_argument("--batch", type=int, default=8, help="Sequences per rank per step (local batch).")
    parser.add_argument("--dps", default="1,64", help="Comma-separated data-parallel sizes to simulate.")
    parser.add_argument("--tokenizers", default="byte,bpe", help="byte and/or bpe (a BPE trained here).")
    parser.add_argument("--seconds", type=float, default=3.0, help="Time each loading setting at least this long.")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1),
                        help="Processes for the one-off tokenization into shards.")
    parser.add_argument("--folder", default=os.path.join("outputs", "bench_data_scale"), help="Scratch folder.")
    return parser.parse_args(argv)


def loading_rate(loader: DataLoader, seconds: float) -> tuple[float, int]:
    """Tokens per second of rank 0's batches, and how many batches were timed (after one untimed)."""
    batch = next(loader)
    tokens_per_batch = batch["input_ids"].numel()
    count, start = 0, time.perf_counter()
    while count < 2 or time.perf_counter() - start < seconds:
        next(loader)
        count += 1
    return tokens_per_batch * count / (time.perf_counter() - start), count


def training_rate(batch: int, seq_len: int, vocab_size: int, steps: int = 3) -> float:
    """Tokens per second of the debug model's train_step on this machine, float32 (after one untimed step)."""
    family = get_family("llama3").model
    args = replace(family.flavors["debugmodel"], vocab_size=vocab_size, max_seq_len=seq_len)
    torch.manual_seed(0)
    model = family.model_cls(args)
    model.init_weights()
    optimizer = build_optimizers([model], Optimizer(lr=1e-4), torch.device("cpu"))
    state = TrainState([model], optimizer, build_lr_scheduler(optimizer, 10**6, LRScheduler()), None,
                       StepSetup(LocalExecutor(StepLoss()), seed=0, max_norm=1.0))
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1))
    data = [{"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}]
    train_step(state, data)["loss"].item()
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step(state, data)["loss"]
    loss.item()
    return batch * seq_len * steps / (time.perf_counter() - start)


def tokenized_dataset(name: str, tokenizer: Tokenizer, args) -> tuple[str, float]:
    """The built-in corpus as token shards in the scratch folder, and the tokenization's tokens/s."""
    folder = os.path.join(args.folder, f"tokens_{name}")
    shutil.rmtree(folder, ignore_errors=True)
    source, info = open_input("builtin", "builtin", "text")
    start = time.perf_counter()
    manifest = tokenize_corpus(source, info, tokenizer, folder, workers=args.workers)
    return folder, manifest["num_tokens"] / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    dps = [int(d) for d in args.dps.split(",")]
    tokenizers: dict[str, Tokenizer] = {}
    for name in args.tokenizers.split(","):
        tokenizers[name] = ByteTokenizer() if name == "byte" else train_bpe(
            BuiltinSource(), 8192, os.path.join(args.folder, "bpe_tokenizer"))
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {sys.version.split()[0]}, "
        f"torch {torch.__version__}; rank 0 of dp ranks, {args.batch} x {args.seq_len} tokens per rank per step"
    )
    train = {name: training_rate(args.batch, args.seq_len, t.vocab_size) for name, t in tokenizers.items()}
    print("| tokenizer | dataset | dp | loading tokens/s per rank | batches timed | vs debug-model training here "
          "| vs Llama 3 8B on H100 (5,762 tok/s/GPU) |")
    print("|---|---|---|---|---|---|---|")
    offline = {}
    for name, tokenizer in tokenizers.items():
        folder, offline[name] = tokenized_dataset(name, tokenizer, args)
        for dp in dps:
            for kind in ("text", "tokens"):
                if kind == "text":
                    source = BuiltinSource()
                else:
                    source = TokenSamples(TokenShards(folder, tokenizer), args.seq_len + 1, (0, "tokens", 0))
                loader = DataLoader(source, tokenizer, args.seq_len, args.batch, 0, dp)
                rate, count = loading_rate(loader, args.seconds)
                print(f"| {name} | {kind} | {dp} | {rate:,.0f} | {count} | {rate / train[name]:,.1f}x "
                      f"| {rate / H100_LLAMA3_8B_TOKENS_PER_S:,.1f}x |")
    for name in tokenizers:
        print(f"debug-model training here ({name} vocab): {train[name]:,.0f} tokens/s; one-off tokenization into "
              f"shards with {args.workers} worker(s): {offline[name]:,.0f} tokens/s")


if __name__ == "__main__":
    main()
