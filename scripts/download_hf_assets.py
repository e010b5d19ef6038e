"""Download Hugging Face assets that dtrain then reads from disk: tokenizers, model configs/weights, and c4 shards.

This is the only part of dtrain that touches the network; training itself never does.

    # tokenizer.json / tokenizer.model / tokenizer_config.json into ./assets/hf/Llama-3.1-8B
    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer config
    # then: --model.hf_assets_path ./assets/hf/Llama-3.1-8B

    # the first 2 of allenai/c4's 1024 English training shards into ./assets/datasets/c4
    python scripts/download_hf_assets.py --dataset c4 --num_shards 2
    # then: --training.dataset c4   (reads ./assets/datasets/c4 unless training.dataset_path says otherwise;
    #       c4_test reads the first 2000 of those documents)

    # the first of its 8 English validation shards, into the same folder
    python scripts/download_hf_assets.py --dataset c4 --split validation --num_shards 1
    # then: --validation.dataset c4_validation
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import fnmatch
import os
import shutil
import sys

# Files of a model repo per asset kind; a kind's files that a repo lacks are skipped (not every repo has all).
ASSET_FILES = {
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "original/tokenizer.model"],
    "config": ["config.json", "generation_config.json"],
    "safetensors": ["model.safetensors.index.json", "*.safetensors"],
}
C4_REPO = "allenai/c4"
# English shards per split of allenai/c4.
C4_TOTAL_SHARDS = {"train": 1024, "validation": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Download Hugging Face assets for dtrain (the only step that needs the network).",
        epilog="Gated models (e.g. meta-llama/*) need their license accepted on huggingface.co and a token.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--repo_id", help="Model repository to download assets from, e.g. meta-llama/Llama-3.1-8B.")
    mode.add_argument("--dataset", choices=["c4"], help="Dataset to download: c4 (allenai/c4, English shards).")
    parser.add_argument(
        "--assets",
        nargs="+",
        choices=sorted(ASSET_FILES),
        default=["tokenizer", "config"],
        help="With --repo_id: which assets to fetch (default: tokenizer config).",
    )
    parser.add_argument(
        "--num_shards",
        type=int,
        default=1,
        help="With --dataset c4: how many shards to fetch (train 1-1024, validation 1-8).",
    )
    parser.add_argument(
        "--split",
        choices=sorted(C4_TOTAL_SHARDS),
        default="train",
        help="With --dataset c4: train (for c4 and c4_test) or validation (for c4_validation) shards.",
    )
    parser.add_argument(
        "--local_dir",
        default=None,
        help="Destination: models go into <local_dir>/<model name> (default ./assets/hf), "
        "datasets into <local_dir> (default ./assets/datasets/<dataset>).",
    )
    parser.add_argument(
        "--hf_token", default=None, help="Hugging Face token (default: the HF_TOKEN environment variable)."
    )
    args = parser.parse_args(argv)
    if args.dataset and not 1 <= args.num_shards <= C4_TOTAL_SHARDS[args.split]:
        parser.error(f"--num_shards must be between 1 and {C4_TOTAL_SHARDS[args.split]} for --split {args.split}")
    return args


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        sys.exit("error: downloading needs huggingface_hub: pip install 'dtrain[hf]'")
    return huggingface_hub


def download_model_assets(repo_id: str, assets: list[str], local_dir: str, token: str | None) -> str:
    """Fetch the asset files of `repo_id` into <local_dir>/<model name>; returns that folder."""
    hub = _hub()
    target = os.path.join(local_dir, repo_id.split("/")[-1])
    repo_files = hub.list_repo_files(repo_id, token=token)
    patterns = [pattern for kind in assets for pattern in ASSET_FILES[kind]]
    wanted = [name for pattern in patterns for name in repo_files if fnmatch.fnmatch(name, pattern)]
    # Weight files live at the top level; original/ holds Meta's consolidated format, not safetensors shards.
    wanted = [name for name in dict.fromkeys(wanted) if name == "original/tokenizer.model" or "/" not in name]
    if not wanted:
        raise SystemExit(f"error: {repo_id} has none of the files for {', '.join(assets)}")
    for name in wanted:
        print(f"downloaded {hub.hf_hub_download(repo_id, name, local_dir=target, token=token)}")
    # Llama 3 keeps its tiktoken file under original/; dtrain looks for tokenizer.model beside tokenizer.json.
    nested = os.path.join(target, "original", "tokenizer.model")
    if os.path.isfile(nested) and not os.path.isfile(os.path.join(target, "tokenizer.model")):
        shutil.copyfile(nested, os.path.join(target, "tokenizer.model"))
    return target


def download_c4(num_shards: int, local_dir: str, token: str | None, split: str = "train") -> str:
    """Fetch the first `num_shards` English `split` shards of allenai/c4 into local_dir/en/."""
    hub = _hub()
    for shard in range(num_shards):
        name = f"en/c4-{split}.{shard:05d}-of-{C4_TOTAL_SHARDS[split]:05d}.json.gz"
        print(f"downloaded {hub.hf_hub_download(C4_REPO, name, repo_type='dataset', local_dir=local_dir, token=token)}")
    return local_dir


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _hub()
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    token = args.hf_token or os.environ.get("HF_TOKEN")
    repo = args.repo_id or C4_REPO
    try:
        if args.repo_id:
            folder = download_model_assets(args.repo_id, args.assets, args.local_dir or "./assets/hf", token)
            print(f"done: set model.hf_assets_path = {folder!r}")
        else:
            local_dir = args.local_dir or f"./assets/datasets/{args.dataset}"
            folder = download_c4(args.num_shards, local_dir, token, args.split)
            names = "validation.dataset = 'c4_validation'" if args.split == "validation" else "training.dataset = 'c4'"
            print(f"done: set {names} and its dataset_path = {folder!r}")
    except GatedRepoError:
        sys.exit(f"error: {repo} is gated: accept its license on https://huggingface.co/{repo} and pass --hf_token")
    except RepositoryNotFoundError:
        sys.exit(f"error: {repo} not found (or private without a valid --hf_token)")
    except HfHubHTTPError as exc:
        sys.exit(f"error: download from {repo} failed: {str(exc).splitlines()[0]}")
    except Exception as exc:
        if not _unreachable(exc):
            raise
        sys.exit(f"error: cannot download from {repo}: {type(exc).__name__}: {str(exc).splitlines()[0]} (this is the "
                 "one step that needs the network to huggingface.co: run it where there is one, then copy ./assets)")


def _unreachable(exc: Exception) -> bool:
    """A failure to reach the Hub (no network, HF_HUB_OFFLINE, a refused or timed-out connection, a disk that cannot
    take the file), not a bug: its HTTP client's errors (httpx, httpx2 or requests by huggingface_hub's version)
    or an OSError."""
    return isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")


if __name__ == "__main__":
    main()
