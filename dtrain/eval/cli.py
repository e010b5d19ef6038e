"""Evaluation of a saved model: `python -m dtrain.eval` (run_eval.sh calls it, on 1..N processes).

    ./run_eval.sh --checkpoint outputs/debug_model --tasks dtrain_tiny            (the run's newest committed step)
    ./run_eval.sh --checkpoint /models/Qwen3-0.6B --hf --tasks hellaswag --limit 100
    NPROC=4 ./run_eval.sh --checkpoint outputs/debug_model/checkpoint/step-40 --tasks dtrain_tiny_choice

The checkpoint is read as run_generate.sh reads it (a run folder stands for its newest committed step; config flags
such as --model.hf_assets_path apply); with several processes each holds the model and answers its share of the
requests. The harness's results JSON goes to --output (default: the dtrain checkpoint's step folder, or
./eval_results for a Hugging Face folder); stdout gets the harness's table and one `eval/<task>/<metric> value`
line per metric.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dtrain.config.evaluation import limit_value
from dtrain.errors import ConfigError


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="run_eval.sh", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, help="run folder, checkpoint folder or step folder; with "
                        "--hf a Hugging Face model folder")
    parser.add_argument("--hf", action="store_true", help="the checkpoint is a Hugging Face folder")
    parser.add_argument("--tasks", required=True, help="comma-separated task, group or tag names (e.g. dtrain_tiny)")
    parser.add_argument("--task_paths", default="", help="comma-separated folders of your own task YAMLs")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's)")
    parser.add_argument("--limit", default="0", help="documents per task: a count, a fraction below 1, 0 = all")
    parser.add_argument("--batch_size", type=int, default=8, help="requests per forward on each process")
    parser.add_argument("--max_gen_toks", type=int, default=None, help="generation length unless a task says")
    parser.add_argument("--output", type=Path, default=None, help="folder of the results JSON")
    parser.add_argument("--log_samples", action="store_true", help="keep every sample in the results JSON")
    return parser.parse_known_args(argv)


def _limit(text: str) -> float | None:
    try:
        return limit_value(float(text), "--limit")
    except ValueError:
        raise ConfigError(f"--limit {text!r} is not a number (a count of documents, or a fraction below 1)") from None


def _output_folder(opts: argparse.Namespace, lm_checkpoint: Path) -> Path:
    if opts.output is not None:
        return opts.output
    return Path("eval_results") if opts.hf else lm_checkpoint


def run(argv: list[str]) -> int:
    import torch.distributed as dist

    from dtrain.eval.evaluate import Evaluation, evaluate, task_metrics, write_results
    from dtrain.eval.loading import load_for_eval
    from dtrain.eval.tasks import resolve_tasks
    from dtrain.generate import resolve_checkpoint

    opts, config_argv = parse_args(argv)
    limit = _limit(opts.limit)
    if opts.batch_size < 1:
        raise ConfigError(f"--batch_size must be >= 1, got {opts.batch_size}")
    tasks = resolve_tasks([t for t in opts.tasks.split(",") if t], [p for p in opts.task_paths.split(",") if p],
                          key="--tasks")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: one process group over the processes
        import torch

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        lm = load_for_eval(opts.checkpoint, opts.hf, config_argv, opts.batch_size, max_gen_toks=opts.max_gen_toks)
        results, seconds = evaluate(lm, Evaluation(tasks, opts.num_fewshot, limit, opts.log_samples))
        if not dist.is_initialized() or dist.get_rank() == 0:
            from lm_eval.utils import make_table

            written = write_results(results, _output_folder(opts, resolve_checkpoint(Path(opts.checkpoint), opts.hf)))
            print(make_table(results))
            for name, value in task_metrics(results).items():
                print(f"{name} {value:.6g}")
            print(f"eval: {len(results['results'])} task(s) in {seconds:.1f} s; results in {written}", file=sys.stderr)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    from dtrain.generate import main as tool_main

    return tool_main(argv, run)
