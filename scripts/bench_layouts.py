"""Benchmark: the same training job under several layouts, compile and float8 settings, side by side in one run.

Each variant is a real `run_train.sh` run (synthetic data, identical model, batch and steps); throughput, MFU and
peak memory are read from its metrics.jsonl, leaving out the first steps (compilation, allocator warm-up). The
report gives tokens/s per rank and for the whole job, each variant's whole-job ratio to the first one, MFU per
device in dtrain's convention (causal attention counted once) and in torchtitan's (the whole attention square),
and the peak memory; `--output FILE` also writes the table there:

    python scripts/bench_layouts.py                                   # eager vs compile, 1 process vs FSDP2/TP on 2
    python scripts/bench_layouts.py --variants eager,fsdp2 --steps 30 -- --model.flavor 1B --training.seq_len 2048
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name -> (processes, overrides)
VARIANTS = {
    "eager": (1, []),
    "compile": (1, ["--compile.enable"]),
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp2_compile": (2, ["--parallelism.data_parallel_shard_degree", "2", "--compile.enable"]),
    "compile_float8_tensorwise": (1, ["--compile.enable", "--model.converters", "float8"]),
    "compile_float8_rowwise": (
        1, ["--compile.enable", "--model.converters", "float8", "--quantize.linear.float8.recipe_name", "rowwise"]
    ),
    "compile_mxfp8": (1, ["--compile.enable", "--model.converters", "mx"]),  # Blackwell-class GPUs only
    # Packed documents (document masking): the dense [seq, seq] mask against FlexAttention's block masks (CUDA).
    "packed_dense": (1, ["--compile.enable", "--training.attention_mask", "block_causal",
                         "--training.attention_mask_backend", "dense"]),
    "packed_flex": (1, ["--compile.enable", "--training.attention_mask", "block_causal",
                        "--training.attention_mask_backend", "flex"]),
}


def run_variant(name: str, steps: int, warmup: int, batch: int, extra: list[str], workdir: Path) -> dict:
    nproc, overrides = VARIANTS[name]
    run_dir = workdir / name
    # The global batch is the same for every variant; each data-parallel rank takes its share of it.
    args = [
        "./run_train.sh", "--training.dataset", "synthetic", "--training.steps", str(steps),
        "--metrics.log_freq", "1", "--training.global_batch_size", str(batch),
        "--training.local_batch_size", str(batch // 2 if name.startswith("fsdp2") else batch),
        "--job.dump_folder", str(run_dir), *overrides, *extra,
    ]
    env = {**os.environ, "NPROC": str(nproc), "VIRTUAL_ENV": sys.prefix,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        # One failed variant (say float8 on a GPU without it) must not cost the others' figures: its row says
        # why, the full error goes to stderr, and the benchmark exits non-zero once the table is out.
        print(f"{name} failed:\n{result.stderr[-3000:]}", file=sys.stderr)
        lines = result.stderr.strip().splitlines() or [f"exit code {result.returncode}"]
        return {"name": name, "processes": nproc, "error": lines[-1][:200]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > warmup]
    per_rank = statistics.median(r["tps"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {"name": name, "processes": nproc, "tps_per_rank": per_rank, "tps_total": per_rank * nproc,
            "loss": records[-1]["loss"], "mfu": statistics.median(mfus) if mfus else None,
            "memory_gib": max(r["memory_gib"] for r in records)}


def full_square_factor(extra: list[str]) -> float:
    """torchtitan's FLOPs per token over dtrain's for the configured model (see models/flops.py)."""
    from dtrain.config import load_config
    from dtrain.models.flops import masked_attention_flops_per_token
    from dtrain.run.prepare import prepare

    cfg = load_config(["--training.dataset", "synthetic", *extra])
    prepared = prepare(cfg)
    ours = prepared.family.model.flops_per_token(prepared.model_args, cfg.training.seq_len)
    return (ours + masked_attention_flops_per_token(prepared.model_args, cfg.training.seq_len)) / ours


def table(rows: list[dict], factor: float) -> list[str]:
    base = next((r["tps_total"] for r in rows if "error" not in r), 1.0)
    lines = [
        "| variant | procs | tok/s/rank | tok/s total | ratio | MFU % | MFU % (torchtitan) | peak GiB | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['processes']} | failed: {r['error']} | | | | | | |")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1f}"
        mfu_tt = "-" if r["mfu"] is None else f"{r['mfu'] * factor:.1f}"
        lines.append(f"| {r['name']} | {r['processes']} | {r['tps_per_rank']:.0f} | {r['tps_total']:.0f} "
                     f"| {r['tps_total'] / base:.2f} | {mfu} | {mfu_tt} | {r['memory_gib']:.2f} | {r['loss']:.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="eager,compile,fsdp2,tp2", help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the median")
    parser.add_argument("--batch", type=int, default=8, help="global batch size (sequences)")
    parser.add_argument("--output", help="also write the table to this file")
    parser.add_argument("extra", nargs="*", help="overrides passed to every run (after --)")
    args = parser.parse_args()

    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_variant(n, args.steps, args.warmup, args.batch, args.extra, Path(tmp)) for n in names]
    header = f"steps={args.steps} (median after {args.warmup}) global_batch={args.batch} overrides={args.extra}"
    report = "\n".join([header, *table(rows, full_square_factor(args.extra))])
    print(report)
    if args.output:
        Path(args.output).write_text(report + "\n")
    if any("error" in r for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
