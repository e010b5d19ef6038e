"""Benchmark: the same training job under several layouts and compile settings, side by side in one invocation.

Each variant is a real `run_train.sh` run (synthetic data, identical model, batch and steps); throughput is read
from its metrics.jsonl, leaving out the first steps (compilation, allocator warm-up). The report gives tokens/s
per rank and for the whole job, and each variant's whole-job ratio to the first one:

    python scripts/bench_layouts.py                                   # eager vs compile, 1 process vs FSDP2/TP on 2
    python scripts/bench_layouts.py --variants eager,fsdp2 --steps 30 -- --model.flavor 1B --training.seq_len 2048
"""

from __future__ import annotations

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
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_rank = statistics.median(r["tps"] for r in records if r["step"] > warmup)
    return {"name": name, "processes": nproc, "tps_per_rank": per_rank, "tps_total": per_rank * nproc,
            "loss": records[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="eager,compile,fsdp2,tp2", help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the median")
    parser.add_argument("--batch", type=int, default=8, help="global batch size (sequences)")
    parser.add_argument("extra", nargs="*", help="overrides passed to every run (after --)")
    args = parser.parse_args()

    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_variant(n, args.steps, args.warmup, args.batch, args.extra, Path(tmp)) for n in names]
    base = rows[0]["tps_total"]
    print(f"steps={args.steps} (median after {args.warmup}) global_batch={args.batch} overrides={args.extra}")
    print(f"{'variant':<14}{'procs':>6}{'tok/s/rank':>12}{'tok/s total':>13}{'ratio':>8}{'final loss':>12}")
    for r in rows:
        print(f"{r['name']:<14}{r['processes']:>6}{r['tps_per_rank']:>12.0f}{r['tps_total']:>13.0f}"
              f"{r['tps_total'] / base:>8.2f}{r['loss']:>12.4f}")


if __name__ == "__main__":
    main()
