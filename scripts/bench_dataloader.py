"""Benchmark: how much of the data loading (read, tokenize, pack) background loading hides behind a training step.

A loop takes a batch, then runs a simulated step that leaves the CPU free (a sleep, as a GPU step leaves the host
mostly idle), for each `training.dataloader` setting side by side: loading in the step (no background), a
background thread (num_workers = 0), and worker processes. It reports the time each step waited for its batch and
the loop's tokens/s, and checks that every setting produced the same batches. Data: the built-in corpus (the
stdlib's .py files), tokenized with a byte-level BPE trained here on part of it (no download).

    python scripts/bench_dataloader.py                              # 2048 x 8 tokens per batch, 100 ms steps
    python scripts/bench_dataloader.py --step_ms 30 --workers 1,2,4 --tokenizer byte
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from dtrain.config.schema import DataLoader as LoaderConfig
from dtrain.data import ByteTokenizer, DataLoader, Tokenizer
from dtrain.data.hf_tokenizer import HFTokenizer
from dtrain.data.sources import BuiltinSource


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq_len", type=int, default=2048, help="Tokens per sequence.")
    parser.add_argument("--batch", type=int, default=8, help="Sequences per batch.")
    parser.add_argument("--step_ms", type=float, default=100.0, help="Simulated step time in milliseconds.")
    parser.add_argument("--steps", type=int, default=30, help="Timed steps per setting.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed steps first (start-up, first fill).")
    parser.add_argument("--workers", default="1,2", help="Comma-separated num_workers settings to run beside 0.")
    parser.add_argument("--prefetch", type=int, default=2, help="training.dataloader.prefetch_factor.")
    parser.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe", help="Tokenizer (bpe: trained here).")
    parser.add_argument("--vocab", type=int, default=8192, help="Vocabulary of the BPE trained here.")
    return parser.parse_args(argv)


def train_bpe(source: BuiltinSource, vocab_size: int, folder: str) -> Tokenizer:
    """A byte-level BPE trained on every 10th file of the corpus, saved as tokenizer.json in `folder`."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (text for position, text in source.documents(0) if position % 10 == 0)
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return HFTokenizer(os.path.join(folder, "tokenizer.json"))


def run(source, tokenizer, args, background: LoaderConfig | None) -> tuple[list[float], float, list[int]]:
    """Waits per timed step (s), the timed loop's wall time (s), and a checksum per batch."""
    loader = DataLoader(source, tokenizer, args.seq_len, args.batch, 0, 1, background=background)
    waits, sums = [], []
    started = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started = time.perf_counter()
        before = time.perf_counter()
        batch = next(loader)
        waited = time.perf_counter() - before
        time.sleep(args.step_ms / 1000)  # the step: the host is free meanwhile
        sums.append(int(batch["input_ids"].sum()))
        if step >= args.warmup:
            waits.append(waited)
    wall = time.perf_counter() - started
    loader.close()
    return waits, wall, sums


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    source = BuiltinSource()
    if args.tokenizer == "bpe":
        tokenizer = train_bpe(source, args.vocab, os.path.join("outputs", "bench_dataloader_tokenizer"))
    else:
        tokenizer = ByteTokenizer()
    settings = [("in the step", None), ("thread (num_workers=0)", LoaderConfig(prefetch_factor=args.prefetch))]
    for workers in (int(w) for w in args.workers.split(",") if w):
        settings.append((f"num_workers={workers}", LoaderConfig(num_workers=workers, prefetch_factor=args.prefetch)))
    tokens = args.seq_len * args.batch
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {sys.version.split()[0]}, "
        f"torch {torch.__version__}; {args.tokenizer} tokenizer (vocab {tokenizer.vocab_size}), batch "
        f"{args.batch} x {args.seq_len}, step {args.step_ms:g} ms, {args.steps} steps after {args.warmup}"
    )
    print("| loading | wait per step, mean (ms) | wait, max (ms) | step wall (ms) | tokens/s | vs in the step |")
    print("|---|---|---|---|---|---|")
    reference, baseline = None, None
    for name, background in settings:
        waits, wall, sums = run(source, tokenizer, args, background)
        reference = reference or sums
        if sums != reference:
            raise SystemExit(f"error: {name} produced other batches than loading in the step")
        rate = tokens * args.steps / wall
        baseline = baseline or rate
        print(
            f"| {name} | {statistics.mean(waits) * 1e3:.1f} | {max(waits) * 1e3:.1f} | "
            f"{wall / args.steps * 1e3:.1f} | {rate:,.0f} | {rate / baseline:.2f}x |"
        )
    print("same batches in every setting: yes")


if __name__ == "__main__":
    main()
