"""Compile study: eager and torch.compile (each requested mode) on the same job, side by side in one table.

    python scripts/compile_study.py --config debug_model
    python scripts/compile_study.py --config llama3_8b --modes default,max-autotune-no-cudagraphs --steps 10 \
        --nproc 8 --training.seq_len 2048 --json study.json
    python scripts/compile_study.py --config debug_model --cache --model.args.n_layers 2

Each variant is a run of its own through run_train.sh (NPROC=--nproc), with a fresh inductor cache
(TORCHINDUCTOR_CACHE_DIR) so that every compile is cold and the rows compare, and its own run folder; the table is
read from the run folders afterwards: compile time from compile_report.json, step times and peak memory from
metrics.jsonl (steady = the median step after the first two), graph breaks, recompiles and FX graph cache hits
from the compile report. With --cache the first compile variant also saves torch's portable compile cache, and
two more rows show what it buys: a fresh inductor cache filled from the portable cache, and the first run's own
inductor cache, warm. Any other `--section.key VALUE` is a trainer override, passed to every variant.

One sample per variant is noisy on a shared machine: `--repeats N` runs the whole study N times (rounds, each in
fresh folders and caches, so every compile stays cold) and the table gives each time's median with its range. The
study warns when the machine is busy before it starts (load average over half the cores). `--dry_run` checks the
arguments and the config and prints each variant's command without running any.
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dtrain.config import load_config
from dtrain.config.cli import parse_argv
from dtrain.errors import DtrainError
from dtrain.observe.compile_report import report_file
from dtrain.parallelize.compile import COMPILE_MODES, CUDA_GRAPH_MODES

REPO = Path(__file__).resolve().parents[1]
MIN_STEPS = 4  # steady = the median of step 3 onwards: at least two steps must be left after the first two
# Trainer keys each variant sets itself, and what to use instead: an override would be silently replaced.
CONTROLLED_KEYS = {
    "training.steps": "use --steps",
    "compile.enable": "use --modes",
    "compile.mode": "use --modes",
    "compile.cache": "use --cache",
    "compile.cache_dir": "use --cache",
    "job.dump_folder": "each variant gets a temporary one",
    "metrics.log_freq": "every step is logged, to time each one",
    "checkpoint.enable": "variants never checkpoint",
}
COLUMNS = ("variant", "compile (s)", "first step (s)", "steady step (ms)", "speedup", "peak memory (GiB)",
           "graph breaks", "recompiles", "FX cache hit/miss")


class UsageError(Exception):
    """A bad argument: printed as one line, before any variant runs."""


@dataclass(frozen=True)
class Variant:
    """One trainer run of the study."""

    name: str
    mode: str | None  # None: eager
    overrides: tuple[str, ...]  # this variant's trainer flags, after the user's
    run_dir: Path
    inductor_cache: Path  # its TORCHINDUCTOR_CACHE_DIR


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors (a missing value, a bad number) as one line too
        raise UsageError(message)


def parse_modes(text: str, cuda: bool) -> list[str]:
    """The compile modes of --modes, in order, without repeats; CUDA-graph modes only where there is CUDA."""
    modes = []
    for mode in (part.strip() for part in text.split(",")):
        if mode not in COMPILE_MODES:
            raise UsageError(f"--modes: unknown mode {mode!r} (choose from {', '.join(COMPILE_MODES)})")
        if mode in CUDA_GRAPH_MODES and not cuda:
            raise UsageError(f"--modes: {mode} captures CUDA graphs and needs a CUDA device, this machine has none "
                             "(use max-autotune-no-cudagraphs or default)")
        if mode not in modes:
            modes.append(mode)
    return modes


def check_overrides(overrides: list[str]) -> None:
    """Refuse trainer overrides of the keys the study sets per variant."""
    try:
        parsed = parse_argv(overrides)
    except DtrainError as err:
        raise UsageError(str(err)) from None
    for spec, _ in parsed.overrides:
        if spec.key in CONTROLLED_KEYS:
            raise UsageError(f"--{spec.key} is set by compile_study.py per variant ({CONTROLLED_KEYS[spec.key]})")


def parse_args(argv: list[str], cuda: bool) -> tuple[argparse.Namespace, list[str]]:
    """The study's own arguments, and the trainer overrides (everything else, in order)."""
    parser = _Parser(prog="compile_study.py", description=__doc__.splitlines()[0], allow_abbrev=False,
                     epilog="Any other --section.key VALUE is a trainer override, passed to every variant.")
    parser.add_argument("--config", required=True, help="config name in train_configs/ or a .toml path")
    parser.add_argument("--modes", default="default", help=f"comma-separated, of {', '.join(COMPILE_MODES)}")
    parser.add_argument("--steps", type=int, default=8, help=f"training steps per variant (at least {MIN_STEPS})")
    parser.add_argument("--nproc", type=int, default=1, help="processes per variant (run_train.sh's NPROC)")
    parser.add_argument("--cache", action="store_true", help="also measure compile.cache: portable and warm local")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one variant may run (default 3600)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the rows to this file (a JSON list)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the whole study; medians and ranges")
    parser.add_argument("--dry_run", action="store_true",
                        help="check the arguments and the config, print each variant's command, run nothing")
    args, overrides = parser.parse_known_args(argv)
    args.modes = parse_modes(args.modes, cuda)
    if args.steps < MIN_STEPS:
        raise UsageError(f"--steps must be at least {MIN_STEPS}: the steady step time is the median after the first "
                         f"two steps (got {args.steps})")
    if args.nproc < 1 or args.timeout <= 0 or args.repeats < 1:
        raise UsageError(f"--nproc and --repeats must be >= 1 and --timeout > 0 "
                         f"(got {args.nproc}, {args.repeats} and {args.timeout})")
    if args.json is not None and not args.json.parent.is_dir():
        raise UsageError(f"--json: folder {str(args.json.parent)!r} does not exist")
    check_overrides(overrides)
    return args, overrides


def plan_variants(modes: list[str], cache: bool, config_caches: bool, workdir: Path) -> list[Variant]:
    """Eager, then each mode; with `cache`, the first mode's run saves the portable cache and two rows follow it.

    `config_caches`: the config itself turns compile.cache on; the other compile variants switch it off, since a
    cache shared between variants would make their compiles warm."""
    portable = ("--compile.cache", "true", "--compile.cache_dir", str(workdir / "portable_cache"))
    no_cache = ("--compile.cache", "false") if config_caches else ()
    planned = [("eager", None, ("--compile.enable", "false"), "eager")]
    for index, mode in enumerate(modes):
        name, compiled = f"compile {mode}", ("--compile.enable", "true", "--compile.mode", mode)
        if cache and index == 0:
            planned += [
                (name, mode, compiled + portable, name),
                (f"{name}, portable cache", mode, compiled + portable, "portable"),
                (f"{name}, local cache warm", mode, compiled + no_cache, name),  # the first run's inductor cache
            ]
        else:
            planned.append((name, mode, compiled + no_cache, name))
    inductor_dirs: dict[str, Path] = {}  # variants naming the same cache share it
    return [
        Variant(name, mode, overrides, workdir / f"run{index}",
                inductor_dirs.setdefault(cache_name, workdir / f"inductor{len(inductor_dirs)}"))
        for index, (name, mode, overrides, cache_name) in enumerate(planned)
    ]


def trainer_command(variant: Variant, config: str, overrides: list[str], steps: int) -> list[str]:
    return ["./run_train.sh", "--config", config, *overrides, "--training.steps", str(steps),
            "--metrics.log_freq", "1", "--checkpoint.enable", "false", "--job.dump_folder", str(variant.run_dir),
            *variant.overrides]


def trainer_env(variant: Variant, nproc: int) -> dict[str, str]:
    """This interpreter's environment (so run_train.sh neither creates nor installs one) with the variant's cache."""
    env = {**os.environ, "NPROC": str(nproc), "VIRTUAL_ENV": sys.prefix,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "TORCHINDUCTOR_CACHE_DIR": str(variant.inductor_cache)}
    env.pop("NGPU", None)  # run_train.sh's alias of NPROC
    env.pop("TRITON_CACHE_DIR", None)  # unset, inductor keeps Triton's kernels in its own (fresh) cache too
    return env


def last_error_line(log: str) -> str:
    """The line that says why a run failed: the trainer's last `error: ...` line (without that prefix: the row's
    error field says it), else the log's last line (a traceback's exception)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1]


def stop(process: subprocess.Popen) -> None:
    """End a variant's whole process group (torchrun and its workers): SIGTERM, then SIGKILL."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def run_variant(variant: Variant, command: list[str], env: dict[str, str], timeout: float) -> str | None:
    """Run one variant to its end; None when it succeeded, else the line that says why not."""
    log_path = variant.run_dir.with_suffix(".log")
    with open(log_path, "w") as log:
        # A session of its own: a timeout or Ctrl-C ends the variant's workers too, not only run_train.sh.
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:g} s"
        finally:
            if process.poll() is None:
                stop(process)
    return None if code == 0 else last_error_line(log_path.read_text(errors="replace"))


def step_times(records: list[dict]) -> tuple[float | None, float | None]:
    """(first step, steady step) in seconds from metrics.jsonl's training records (one per step): `elapsed_s` is
    the time since training started, so step 1's is the first step (compile included) and the differences of
    consecutive steps are step times; steady is their median from step 3 on (step 2 may still warm up)."""
    elapsed = {r["step"]: r["elapsed_s"] for r in records if "elapsed_s" in r}
    deltas = [elapsed[step] - elapsed[step - 1] for step in sorted(elapsed) if step >= 3 and step - 1 in elapsed]
    return elapsed.get(1), statistics.median(deltas) if deltas else None


def read_run(run_dir: Path) -> dict:
    """The measurements of one finished run folder (rank 0's files); compile fields are None without a report."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    first, steady = step_times(records)
    memory = [r["memory_gib"] for r in records if r.get("memory_gib") is not None]
    row = {"first_step_s": first, "steady_step_s": steady, "peak_memory_gib": max(memory, default=None),
           "compile_time_s": None, "graph_breaks": None, "recompiles": None, "fx_graph_cache": None}
    report_path = report_file(run_dir, 0)
    if report_path.exists():
        report = json.loads(report_path.read_text())
        fx = report.get("cache", {}).get("fx_graph", {})
        row.update(compile_time_s=report["compile_time_s"], graph_breaks=report["graph_break_count"],
                   recompiles=len(report["recompiles"]),
                   fx_graph_cache={"hit": fx.get("hit", 0), "miss": fx.get("miss", 0)})
    return row


def with_speedups(rows: list[dict]) -> list[dict]:
    """Each row with `speedup`: the eager row's steady step time over its own (None where either is missing)."""
    eager = next((row["steady_step_s"] for row in rows if row["mode"] is None and row.get("steady_step_s")), None)
    return [{**row, "speedup": eager / row["steady_step_s"] if eager and row.get("steady_step_s") else None}
            for row in rows]


def _cell(value, spec: str, spread: tuple[float, float] | None = None, scale: int = 1) -> str:
    """A number, with its range over the rounds as `median (min-max)` when there were several."""
    if value is None:
        return "-"
    text = format(value * scale, spec)
    if spread is not None and spread[0] != spread[1]:
        text += f" ({format(spread[0] * scale, spec)}–{format(spread[1] * scale, spec)})"
    return text


def format_table(rows: list[dict]) -> str:
    """The rows as markdown, one per variant; an `error` column appears when a variant failed."""
    failed = any(row["error"] for row in rows)
    header = [*COLUMNS, "error"] if failed else list(COLUMNS)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        fx = row.get("fx_graph_cache")
        steady = row.get("steady_step_s")
        spread = row.get("spread", {})
        cells = [
            row["variant"], _cell(row.get("compile_time_s"), ".1f", spread.get("compile_time_s")),
            _cell(row.get("first_step_s"), ".2f", spread.get("first_step_s")),
            _cell(steady, ".1f", spread.get("steady_step_s"), scale=1000), _cell(row.get("speedup"), ".2f"),
            _cell(row.get("peak_memory_gib"), ".2f"), _cell(row.get("graph_breaks"), "d"),
            _cell(row.get("recompiles"), "d"), "-" if fx is None else f"{fx['hit']}/{fx['miss']}",
        ]
        if failed:
            cells.append(row["error"] or "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_round(args: argparse.Namespace, overrides: list[str], config_caches: bool, workdir: Path,
              label: str = "") -> list[dict]:
    """Run every variant in turn; the rows in order, with measurements or the error that ended the variant."""
    variants = plan_variants(args.modes, args.cache, config_caches, workdir)
    rows = []
    for number, variant in enumerate(variants, 1):
        print(f"{label}[{number}/{len(variants)}] {variant.name}", file=sys.stderr, flush=True)
        command = trainer_command(variant, args.config, overrides, args.steps)
        error = run_variant(variant, command, trainer_env(variant, args.nproc), args.timeout)
        row = {"variant": variant.name, "mode": variant.mode, "error": error}
        if error is None:
            try:
                row.update(read_run(variant.run_dir))
            except (OSError, ValueError, KeyError) as err:  # a run that finished without its files
                row["error"] = f"unreadable results: {err}"
        rows.append(row)
        if variant.mode is None and row["error"]:
            break  # without eager there is nothing to compare with, and the same config would fail again
    return rows


TIMED = ("compile_time_s", "first_step_s", "steady_step_s")


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per variant: the first round's row with each time replaced by its median over the rounds that
    measured it, and `spread` (min, max) beside; a variant that failed in any round keeps that round's error."""
    rows = []
    for samples in zip(*rounds):
        failed = next((row for row in samples if row["error"]), None)
        if failed is not None or len(samples) == 1:
            rows.append(failed or samples[0])
            continue
        row = {**samples[0], "rounds": len(samples), "spread": {}}
        for key in TIMED:
            values = [r[key] for r in samples if r.get(key) is not None]
            if values:
                row[key] = statistics.median(values)
                row["spread"][key] = (min(values), max(values))
        rows.append(row)
    return rows


def run_study(args: argparse.Namespace, overrides: list[str], config_caches: bool, workdir: Path) -> list[dict]:
    """`args.repeats` rounds of every variant, each round in folders (and caches) of its own; combined rows."""
    rounds = []
    for number in range(args.repeats):
        round_dir = workdir / f"round{number}"
        round_dir.mkdir()
        label = f"round {number + 1}/{args.repeats} " if args.repeats > 1 else ""
        rounds.append(run_round(args, overrides, config_caches, round_dir, label))
        if rounds[-1][0]["error"]:
            break  # eager failed: the other rounds would too
    if len({len(r) for r in rounds}) > 1:  # a round stopped early: compare only complete ones
        rounds = [r for r in rounds if len(r) == len(rounds[0])][:1]
    return with_speedups(combine_rounds(rounds))


def busy_machine_warning(load: float, cores: int) -> str | None:
    """One warning line when other work competes for the cores (load average over half of them), else None."""
    if load <= cores / 2:
        return None
    return (f"warning: the machine is busy (load average {load:.1f} on {cores} cores) before the study: other work "
            f"competes with the variants and single timings vary by tens of percent; compare rows of one study "
            f"only, and use --repeats 3 (or a quiet machine) before drawing conclusions")


CPU_CACHE_NOTE = ("note: on a CPU the portable compile cache cannot carry the compiled C++ kernels (torch leaves "
                  "their shared objects out of the artifacts), so its row still builds them and saves less than "
                  "the warm local cache (docs/benchmarks.md, compile caches)")


def main(argv: list[str]) -> int:
    cuda = torch.cuda.is_available()
    try:
        args, overrides = parse_args(argv, cuda)
        # The user's config and overrides, checked once here rather than failing in every variant.
        cfg = load_config(["--config", args.config, *overrides])
    except (UsageError, DtrainError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        for variant in plan_variants(args.modes, args.cache, cfg.compile.cache, Path("<study folder>")):
            command = " ".join(trainer_command(variant, args.config, overrides, args.steps))
            print(f"{variant.name}: NPROC={args.nproc} {command}")
        return 0
    warning = busy_machine_warning(os.getloadavg()[0], os.cpu_count() or 1)
    if warning:
        print(warning, file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="compile_study_") as workdir:
            rows = run_study(args, overrides, cfg.compile.cache, Path(workdir))
    except KeyboardInterrupt:
        return 130
    if rows[0]["error"]:  # the study stopped there
        print(f"error: the eager run failed: {rows[0]['error']}", file=sys.stderr)
        return 1
    print(f"config {args.config}, {args.steps} steps, {args.nproc} process(es) on {'cuda' if cuda else 'cpu'}, "
          f"torch {torch.__version__}" + (f", overrides: {' '.join(overrides)}" if overrides else ""))
    print(format_table(rows))
    if args.repeats > 1:
        print(f"each time: the median of {args.repeats} rounds (range in brackets)")
    if warning:
        print(warning)  # beside the table, which is what gets copied
    if args.cache and not cuda:
        print(CPU_CACHE_NOTE)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if any(row["error"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
