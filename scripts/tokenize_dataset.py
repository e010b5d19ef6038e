"""Tokenize a corpus once into token shards for `--training.dataset tokens` (docs/data.md, "Pre-tokenizing a corpus").

    python scripts/tokenize_dataset.py --input ./corpus --output ./data/corpus --hf_assets_path ./assets/hf/Llama-3.1-8B
    python scripts/tokenize_dataset.py --input builtin --output ./data/builtin          # the built-in corpus, bytes
    python scripts/tokenize_dataset.py --verify ./data/corpus                            # re-read every byte

`--input` is a file or folder of .txt/.jsonl/.json/.parquet files (a folder covers many files), a local Hugging
Face dataset (a save_to_disk folder, or data files with --kind hf), or `builtin`; several paths of one kind are read
one after the other. An interrupted run (Ctrl-C, a crash) continues when run again with the same arguments.
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import os
import shlex
import sys

from dtrain.config.schema import Model
from dtrain.data.corpus_input import INPUT_KINDS, open_input
from dtrain.data.shard_verify import verify
from dtrain.data.tokenize_corpus import DEFAULT_SHARD_TOKENS, Progress, command_line_message, tokenize_corpus
from dtrain.data.tokenizer_factory import build_tokenizer
from dtrain.errors import DtrainError

# Every worker reads (and parses) every document to find its own, so beyond this many reading outweighs the gain.
MAX_DEFAULT_WORKERS = 8


def default_workers() -> int:
    """One tokenizing process per core this process may use, up to MAX_DEFAULT_WORKERS (writing the shards takes
    little next to tokenizing with a BPE tokenizer)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_DEFAULT_WORKERS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", metavar="PATH",
                        help="Files or folders of text/JSONL/Parquet, a local HF dataset, or 'builtin'.")
    parser.add_argument("--output", help="The dataset folder to write (new or empty, or an interrupted one).")
    parser.add_argument("--kind", choices=INPUT_KINDS, default="auto",
                        help="How to read --input; auto: builtin by name, hf for a save_to_disk folder, else files.")
    parser.add_argument("--text_field", default="text", help="Field of the text in JSONL, Parquet and HF datasets.")
    parser.add_argument("--tokenizer", choices=("auto", "byte", "hf", "tiktoken"), default="auto",
                        help="As model.tokenizer: auto = byte without --hf_assets_path.")
    parser.add_argument("--hf_assets_path", default="", help="As model.hf_assets_path: the tokenizer's folder or file.")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="Tokenizing processes; 0 tokenizes in this process (default: the cores, at most 8).")
    parser.add_argument("--shard_tokens", type=int, default=None,
                        help=f"Close a shard after the document that brings it to this many tokens "
                        f"(default {DEFAULT_SHARD_TOKENS}, or the folder's own when resuming).")
    parser.add_argument("--verify", metavar="DIR", help="Check a dataset folder (checksums, documents) and exit.")
    args = parser.parse_args(argv)
    if args.verify is None and (args.input is None or args.output is None):
        parser.error("give --input and --output (or --verify DIR)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verify is not None:
        try:
            print(verify(args.verify))
        except DtrainError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        return 0
    progress = Progress(enabled=True)
    try:
        tokenizer = build_tokenizer(Model(tokenizer=args.tokenizer, hf_assets_path=args.hf_assets_path))
        source, info = open_input(args.input, args.kind, args.text_field)
        manifest = tokenize_corpus(source, info, tokenizer, args.output, workers=args.workers,
                                   shard_tokens=args.shard_tokens, progress=progress)
    except DtrainError as err:
        progress.end_line()
        print(f"error: {command_line_message(str(err))}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        progress.end_line()
        command = " ".join(shlex.quote(a) for a in ["python", "scripts/tokenize_dataset.py", *(argv or sys.argv[1:])])
        print(f"interrupted: {args.output} keeps its {progress.shards} whole shard(s); to finish it, run again: "
              f"{command}", file=sys.stderr)
        return 130
    summary = (f"{manifest['num_documents']:,} documents, {manifest['num_tokens']:,} tokens in "
               f"{len(manifest['shards'])} shard(s)")
    if not progress.started:
        print(f"{args.output} is already complete ({summary}); nothing to do")
    else:
        print(f"done: {args.output} holds {summary}; train with --training.dataset tokens --training.dataset_path "
              f"{args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
