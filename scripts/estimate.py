"""Estimate a run before renting it: per-rank memory, pipeline bubble, communication and step time (docs/planning.md).

    python scripts/estimate.py --config llama3_405b --world_size 512 --hardware h100
    python scripts/estimate.py --config llama3_8b --world_size 8 --training.local_batch_size 2 --json out.json
    python scripts/estimate.py --config debug_model --world_size 4 --parallelism.pipeline_parallel_degree 2 \
        --training.local_batch_size 8 --hardware cpu --advise microbatch

Any `--section.key VALUE` overrides the config as in run_train.sh. Nothing is allocated and nothing communicates:
the model and layout are built on the meta device under a fake process group of --world_size ranks. A layout that
does not fit is followed by the changes that make it fit, each re-estimated, as the flags to append.
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import json
import sys

import torch

from dtrain.config import load_config
from dtrain.errors import DtrainError
from dtrain.estimate import estimate, format_report, load_hardware, profile_names
from dtrain.estimate.advice import Advice, changes_that_fit, format_changes
from dtrain.estimate.microbatch import advise_microbatch, format_advice


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Any --section.key VALUE overrides the config as run_train.sh takes them (--config: a file or a "
               "train_configs/ name). A layout that does not fit is followed by the changes that make it fit.",
    )
    parser.add_argument("--world_size", type=int, required=True, help="Devices (ranks) of the run.")
    parser.add_argument("--hardware", default="h100", help=f"Device profile: {', '.join(profile_names())}.")
    parser.add_argument("--json", metavar="FILE",
                        help="Also write the numbers, and the changes that make it fit, as JSON.")
    parser.add_argument("--advise", choices=("microbatch",),
                        help="microbatch: measure each pipeline microbatch size's stage time on this device and rank "
                             "them by the (B/(d·b) + p − 1)(t_f + t_b) rule, within the hardware's memory.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="Where --advise measures (default: cuda when there is one).")
    args, config_args = parser.parse_known_args(argv)
    if args.world_size < 1:
        parser.error(f"--world_size must be at least 1, got {args.world_size}")
    return args, config_args


def main(argv: list[str] | None = None) -> None:
    args, config_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        hardware = load_hardware(args.hardware)
        cfg = load_config(config_args)
        if args.advise == "microbatch":
            print(format_advice(advise_microbatch(cfg, args.world_size, hardware, torch.device(args.device)), hardware))
            return
        cache: dict = {}  # the built model parts, shared with the re-estimates of the advice
        result = estimate(cfg, args.world_size, hardware, cache)
        advice = Advice(0, [], None)
        if not result.fits:
            advice = changes_that_fit(config_args, args.world_size, hardware, cache)
    except DtrainError as err:
        sys.exit(f"error: {err}")
    dtype = cfg.training.mixed_precision_param
    print(format_report(result, dtype))
    if not result.fits:
        print("\n" + format_changes(advice, hardware))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result.to_json(dtype), **advice.to_json()}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
