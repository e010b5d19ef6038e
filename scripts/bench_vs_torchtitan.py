"""dtrain against torchtitan 0.2.2's own trainer on one GPU: the same TOML, card, settings, seed and batches.

    python scripts/bench_vs_torchtitan.py --shapes llama3_1b --variants eager,compile,compile_float8 --rounds 2
    python scripts/bench_vs_torchtitan.py --dry_run        # CPU: tiny shapes, torchtitan's components in-process

Each (shape, variant) runs both sides once per round, the order swapping every round so that neither always runs
on a cooler or warmer card. Both read torchtitan's TOML for the shape (tests/config/torchtitan_v0_2_2, the files
torchtitan ships) with the same flags; both start from one seed checkpoint that torchtitan writes and train on
dtrain's batches (the data is an input of the comparison, not part of it: scripts/torchtitan_trainer.py feeds them
to torchtitan's Trainer), so their losses must agree step by step: bf16 rounding on the GPU, 1e-5 in fp32 on CPU.

The table gives, per side, tokens/s and step time (median after --warmup steps, median over rounds), MFU in both
conventions (dtrain's counts causal attention once; torchtitan's the whole attention square: models/flops.py)
against the card's peak in the compute dtype (dtrain/estimate/hardware), peak memory (dtrain: allocated;
torchtitan: reserved, as each logs it), the first step's excess over the median step (compilation, allocator
warm-up), the largest relative loss difference of any step, and dtrain's estimate of its step time and memory
(scripts/estimate.py) beside its measurement, with the error.

On a GPU torchtitan's side is `torchrun ... scripts/torchtitan_trainer.py` (its Trainer). torchtitan's Trainer does
not start on a CPU, so --dry_run runs its components in the order its Trainer calls them
(tests/reference/torchtitan_train_loop.py, the reference suite's loop, which also writes the seed) on tiny shapes
in fp32, so that everything else (flags, seeds, runs, metrics, the estimate, the table) is exercised in CI.
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench_layouts import full_square_factor

REPO = Path(__file__).resolve().parents[1]
TOMLS = REPO / "tests" / "config" / "torchtitan_v0_2_2"
REFERENCE_LOOP = REPO / "tests" / "reference" / "torchtitan_train_loop.py"
# torchtitan's Trainer as its own run_train.sh starts it (torchrun), on one GPU.
TORCHTITAN_TRAINER = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                      str(REPO / "scripts" / "torchtitan_trainer.py")]


@dataclass(frozen=True)
class Shape:
    toml: str
    flags: tuple[str, ...] = ()  # both sides (--model.args.* reach torchtitan's flavor args through its launcher)
    dtrain_flags: tuple[str, ...] = ()  # dtrain's start from torchtitan's seed (tests/reference says why)


# torchtitan 0.2.2 has no Llama 3 1B flavor: its 8B flavor at Llama 3.2 1B's width (untied: torchtitan cannot tie).
SHAPES = {
    "debug": Shape("llama3_debug_model.toml"),
    "llama3_1b": Shape("llama3_8b.toml", (
        "--model.args.dim", "2048", "--model.args.n_layers", "16", "--model.args.n_heads", "32",
        "--model.args.n_kv_heads", "8", "--model.args.ffn_dim_multiplier", "1.5",
    )),
    # The 8B width with as many layers as one 80 GB card holds with AdamW (--layers_8b for a bigger card).
    "llama3_8b_width": Shape("llama3_8b.toml"),
    "qwen3_1.7b": Shape("qwen3_1.7b.toml", dtrain_flags=("--checkpoint.initial_load_writer", "torchtitan")),
    "qwen3_moe": Shape("qwen3_moe_debug.toml", dtrain_flags=(
        "--checkpoint.initial_load_writer", "torchtitan", "--checkpoint.initial_load_partial",
    )),
    "deepseek_v3": Shape("deepseek_v3_debug_model.toml"),
    # Its TOML spreads the experts over 8 GPUs: one GPU holds them all at 4 layers.
    "deepseek_v3_16b_width": Shape(
        "deepseek_v3_16b.toml", ("--model.args.n_layers", "4", "--parallelism.expert_parallel_degree", "1")
    ),
}
# Flags for both sides. Eager and the AC variants compile nothing; the TOMLs' own AC (selective) is set per variant.
VARIANTS = {
    "eager": ("--activation_checkpoint.mode", "none"),
    "compile": ("--compile.enable", "--activation_checkpoint.mode", "none"),
    "compile_float8": (
        "--compile.enable", "--model.converters", "quantize.linear.float8", "--activation_checkpoint.mode", "none",
    ),
    "ac_full": ("--activation_checkpoint.mode", "full"),
    "ac_selective": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
}
# torchtitan's console line: step, loss, its peak reserved memory and tokens/s (ANSI colours stripped first).
TORCHTITAN_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+)\s+.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Run:
    """One side's run of one (shape, variant, round): per-step losses and wall times, and its peak memory."""

    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_gib: float | None = None
    error: str | None = None


def shape_flags(name: str, layers_8b: int) -> list[str]:
    flags = list(SHAPES[name].flags)
    return flags + ["--model.args.n_layers", str(layers_8b)] if name == "llama3_8b_width" else flags


def common_argv(shape: str, variant: str, args: argparse.Namespace) -> list[str]:
    """The flags both sides get: the shape's TOML and flags, the variant, the run's size, seed and data."""
    return [
        "--job.config_file", str(TOMLS / SHAPES[shape].toml), *shape_flags(shape, args.layers_8b),
        *VARIANTS[variant], "--training.dataset", "builtin", "--model.hf_assets_path", "",
        "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), "--training.global_batch_size", str(args.batch),
        "--metrics.log_freq", "1", "--debug.seed", "0", *args.extra,
    ]


def _run(command: list[str], log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NPROC": "1", "VIRTUAL_ENV": sys.prefix,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    log.write_text(result.stdout + result.stderr)
    return result


def _failed(result: subprocess.CompletedProcess, log: Path) -> Run:
    # One failed run (say float8 on a card without it) must not cost the others' figures: its row says why.
    lines = result.stderr.strip().splitlines() or [f"exit code {result.returncode}"]
    print(f"failed, see {log}:\n{result.stderr[-3000:]}", file=sys.stderr)
    return Run(error=lines[-1][:160])


def torchtitan_seed(argv: list[str], work: Path) -> Path:
    """torchtitan's initialised weights for the shape (its create_seed_checkpoint), on a GPU."""
    command = [*TORCHTITAN_TRAINER, *argv, "--torchtitan_only",
               "--job.dump_folder", str(work), "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
               "--checkpoint.last_save_model_only"]  # the weights only, as dtrain's initial load reads them
    result = _run(command, work.with_suffix(".log"))
    if result.returncode != 0:
        raise SystemExit(f"torchtitan's seed checkpoint failed:\n{result.stderr[-3000:]}")
    return work / "checkpoint" / "step-0"


def run_torchtitan_components(argv: list[str], work: Path) -> Run:
    """The dry run's torchtitan side: its components in its Trainer's order, which also write the seed (CPU)."""
    work.mkdir()  # the loop's file store and outputs go there
    result = _run([sys.executable, str(REFERENCE_LOOP), str(work), *argv], work.with_suffix(".log"))
    if result.returncode != 0:
        return _failed(result, work.with_suffix(".log"))
    records = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    return Run([r["loss"] for r in records], [r["time_s"] for r in records])


def run_torchtitan_trainer(argv: list[str], work: Path, seed: Path, tokens_per_step: int) -> Run:
    """torchtitan's Trainer from `seed`, saving nothing (GPU); its figures are read from its console lines."""
    command = [*TORCHTITAN_TRAINER, *argv, "--torchtitan_only",
               "--job.dump_folder", str(work), "--checkpoint.enable", "--checkpoint.load_only",
               "--checkpoint.initial_load_path", str(seed)]
    result = _run(command, work.with_suffix(".log"))
    if result.returncode != 0:
        return _failed(result, work.with_suffix(".log"))
    run = Run()
    for match in TORCHTITAN_LINE.finditer(ANSI.sub("", result.stdout + result.stderr)):
        run.losses.append(float(match[2]))
        run.step_s.append(tokens_per_step / float(match[4].replace(",", "")))
        run.peak_gib = max(run.peak_gib or 0.0, float(match[3]))
    return run if run.losses else Run(error=f"no step line in torchtitan's log {work.with_suffix('.log')}")


def run_dtrain(argv: list[str], work: Path, seed: Path, shape: str, tokens_per_step: int) -> Run:
    command = ["./run_train.sh", *argv, "--job.dump_folder", str(work), "--checkpoint.initial_load_path", str(seed),
               *SHAPES[shape].dtrain_flags]
    result = _run(command, work.with_suffix(".log"))
    if result.returncode != 0:
        return _failed(result, work.with_suffix(".log"))
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    return Run([r["loss"] for r in records], [tokens_per_step / r["tps"] for r in records],
               max(r["memory_gib"] for r in records))


@dataclass
class Side:
    """One side's figures for one (shape, variant) over its rounds."""

    step_s: float
    first_step_excess_s: float
    peak_gib: float | None

    @classmethod
    def of(cls, runs: list[Run], warmup: int) -> Side:
        medians = [statistics.median(r.step_s[warmup:]) for r in runs]
        excess = [r.step_s[0] - m for r, m in zip(runs, medians)]
        peaks = [r.peak_gib for r in runs if r.peak_gib is not None]
        return cls(statistics.median(medians), statistics.median(excess), max(peaks) if peaks else None)


def max_relative_loss_difference(pairs: list[tuple[Run, Run]]) -> float:
    """The largest relative difference of any step's loss between the two sides of the same round."""
    return max(abs(a - b) / max(abs(b), 1e-12) for ours, theirs in pairs for a, b in zip(ours.losses, theirs.losses))


@dataclass
class Estimated:
    step_s: float
    memory_gib: float
    flops_per_token: float  # dtrain's convention
    peak_flops: float


def estimated(argv: list[str], hardware_name: str) -> Estimated:
    """dtrain's estimate of the run on one device of `hardware_name` (dtrain/estimate)."""
    from dtrain.config import load_config
    from dtrain.estimate import estimate, load_hardware

    cfg = load_config(argv)
    hardware = load_hardware(hardware_name)
    result = estimate(cfg, 1, hardware)
    return Estimated(result.step_time_s, result.busiest.memory.total / 2**30, result.flops_per_token,
                     hardware.peak_flops(cfg.training.mixed_precision_param))


def _error(estimate: float, measured: float | None) -> str:
    return "-" if not measured else f"{100 * (estimate - measured) / measured:+.0f}%"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


TABLE_HEADER = [
    "| shape | variant | side | tok/s | step s | MFU % | MFU % (torchtitan) | peak GiB | first step +s "
    "| max loss diff | est. step s (err) | est. GiB (err) |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def table_rows(shape: str, variant: str, sides: dict[str, Side | str], loss_diff: float | None,
               est: Estimated, factor: float, tokens_per_step: int) -> list[str]:
    """The (shape, variant)'s two rows: torchtitan's, then dtrain's with its estimate beside it."""
    rows = []
    for name in ("torchtitan", "dtrain"):
        side = sides[name]
        if isinstance(side, str):
            rows.append(f"| {shape} | {variant} | {name} | failed: {side} |" + " |" * 8)
            continue
        tps = tokens_per_step / side.step_s
        mfu = 100 * tps * est.flops_per_token / est.peak_flops
        diff = "-" if loss_diff is None else f"{loss_diff:.1e}"
        estimate = "" if name == "torchtitan" else (
            f" {est.step_s:.3f} ({_error(est.step_s, side.step_s)}) | {est.memory_gib:.2f} "
            f"({_error(est.memory_gib, side.peak_gib)}) |"
        )
        rows.append(
            f"| {shape} | {variant} | {name} | {tps:.0f} | {side.step_s:.3f} | {mfu:.1f} | {mfu * factor:.1f} "
            f"| {_gib(side.peak_gib)} | {side.first_step_excess_s:.2f} | {diff} |" + (estimate or " | |")
        )
    return rows


def environment_header(command: str, hardware: str, dry_run: bool) -> list[str]:
    """Date, card, versions and the exact command, as docs/benchmarks.md records them."""
    import importlib.metadata

    import torch

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    card = torch.cuda.get_device_name() if torch.cuda.is_available() and not dry_run else "CPU (dry run)"
    return [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; card: {card} "
        f"(estimates for the {hardware} profile)",
        f"torch {torch.__version__}, torchao {version('torchao')}, torchtitan {version('torchtitan')}",
        f"command: `{command}`",
        "",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama3_1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--variants", default="eager,compile,compile_float8",
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side per (shape, variant), alternating")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="leading steps left out of the median step time")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (one GPU)")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--layers_8b", type=int, default=8, help="layers of the llama3_8b_width shape")
    parser.add_argument("--hardware", help="estimator profile (default: h200/h100 by the card's name, cpu dry)")
    parser.add_argument("--dry_run", action="store_true",
                        help="CPU: debug shape at seq 64, batch 2, 4 steps in fp32; torchtitan's components")
    parser.add_argument("--output", help="also write the report to this file")
    parser.add_argument("extra", nargs="*", help="flags for both sides' runs (after --)")
    args = parser.parse_args(argv)
    for key, valid in (("shapes", SHAPES), ("variants", VARIANTS)):
        unknown = [n for n in getattr(args, key).split(",") if n not in valid]
        if unknown:
            parser.error(f"--{key}: unknown {unknown}; valid: {', '.join(valid)}")
    if args.dry_run:
        # Tiny and in fp32, where the two sides' losses agree to 1e-5; deterministic kernels as in tests/reference.
        args.seq_len, args.batch = 64, 2
        args.extra = ["--training.mixed_precision_param", "float32", "--debug.deterministic", *args.extra]
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    return args


def default_hardware(dry_run: bool) -> str:
    import torch

    if dry_run or not torch.cuda.is_available():
        return "cpu"
    return "h200" if "H200" in torch.cuda.get_device_name() else "h100"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hardware = args.hardware or default_hardware(args.dry_run)
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    tokens_per_step = args.batch * args.seq_len
    runs: dict[tuple[str, str, str], list[Run]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        seeds: dict[str, Path] = {}
        if not args.dry_run:
            for shape in shapes:
                seeds[shape] = torchtitan_seed(common_argv(shape, "eager", args), work / f"seed_{shape}")
        for round_ in range(args.rounds):
            for shape in shapes:
                for variant in variants:
                    flags = common_argv(shape, variant, args)
                    # torchtitan first in even rounds: the dry run's first torchtitan run writes the seed.
                    for side in ("torchtitan", "dtrain") if round_ % 2 == 0 else ("dtrain", "torchtitan"):
                        folder = work / f"{side}_{shape}_{variant}_{round_}"
                        if side == "torchtitan" and args.dry_run:
                            run = run_torchtitan_components(flags, folder)
                            if run.error is None:
                                seeds.setdefault(shape, folder / "seed")
                        elif side == "torchtitan":
                            run = run_torchtitan_trainer(flags, folder, seeds[shape], tokens_per_step)
                        elif shape in seeds:
                            run = run_dtrain(flags, folder, seeds[shape], shape, tokens_per_step)
                        else:  # the dry run's torchtitan side failed before writing it
                            run = Run(error="no seed checkpoint: torchtitan's side failed")
                        runs.setdefault((shape, variant, side), []).append(run)
    command = "python scripts/bench_vs_torchtitan.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = environment_header(command, hardware, args.dry_run) + [
        f"{args.steps} steps (step time: median after {args.warmup}, over {args.rounds} rounds), batch "
        f"{args.batch} x {args.seq_len}, flags for both: {args.extra}", "", *TABLE_HEADER,
    ]
    failed = False
    for shape in shapes:
        for variant in variants:
            flags = common_argv(shape, variant, args)
            sides: dict[str, Side | str] = {}
            for side in ("torchtitan", "dtrain"):
                side_runs = runs[(shape, variant, side)]
                errors = [r.error for r in side_runs if r.error]
                sides[side] = errors[0] if errors else Side.of(side_runs, args.warmup)
                failed = failed or bool(errors)
            pairs = list(zip(runs[(shape, variant, "dtrain")], runs[(shape, variant, "torchtitan")]))
            loss_diff = None if any(r.error for pair in pairs for r in pair) else max_relative_loss_difference(pairs)
            lines += table_rows(shape, variant, sides, loss_diff, estimated(flags, hardware),
                                full_square_factor(flags), tokens_per_step)
    report = "\n".join(lines)
    print(report)
    if args.output:
        Path(args.output).write_text(report + "\n")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
