"""[eval]: downstream evaluation with EleutherAI's lm-evaluation-harness during and at the end of training.

The harness runs on the model as it trains (dtrain/eval/): every `every` steps and/or after the last one, each task's
metrics go to the console, metrics.jsonl, TensorBoard and W&B as `eval/<task>/<metric>`, and the harness's results
JSON is written beside that step's checkpoint. What needs the harness (task names, their data on disk) is checked
before training by dtrain/eval/training.py; what the config alone decides is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dtrain.config.options import opt
from dtrain.errors import ConfigError

if TYPE_CHECKING:
    from dtrain.config.schema import JobConfig


@dataclass
class Eval:
    enable: bool = opt(False, "Evaluate on the harness's tasks during (every) and after (at_end) training.")
    tasks: list[str] = opt(
        ["dtrain_tiny"],
        "Task, group or tag names: the bundled tiny set (dtrain_tiny, or dtrain_tiny_choice, dtrain_tiny_text, "
        "dtrain_tiny_arithmetic), the harness's own (their data must be on disk), or ones in eval.task_paths.",
    )
    task_paths: list[str] = opt([], "Folders of your own task YAMLs (data_files may be relative to the YAML).")
    num_fewshot: int = opt(-1, "Few-shot examples per prompt; -1 = each task's own default.", minimum=-1)
    limit: float = opt(
        0.0, "Documents per task: 0 = all, a whole number >= 1 = that many, a fraction below 1 = that share.",
        minimum=0.0,
    )
    batch_size: int = opt(8, "Requests per forward on each rank.", minimum=1)
    max_gen_toks: int = opt(256, "Tokens a generation task may generate unless it says (the harness's default).",
                            minimum=1)
    every: int = opt(0, "Evaluate after every this many steps (0 = only at_end).", minimum=0)
    at_end: bool = opt(True, "Evaluate after the last step (once, if `every` already did at that step).")
    log_samples: bool = opt(False, "Keep every sample (prompt, answers, metrics) in the results JSON.")
    bootstrap_iters: int = opt(1000, "Bootstrap resamples of the stderr of non-mean metrics (0 = none).", minimum=0)


def limit_value(limit: float, key: str = "eval.limit") -> float | None:
    """The harness's `limit`: None for all documents, an int count, or a fraction in (0, 1)."""
    if limit == 0:
        return None
    if limit >= 1:
        if limit != int(limit):
            raise ConfigError(f"{key} = {limit}: a count of documents is a whole number (or a fraction below 1)")
        return int(limit)
    return limit


def check_eval(cfg: JobConfig) -> None:
    """[eval] against the rest of the config: a schedule that runs, and a layout the backend evaluates on."""
    e = cfg.eval
    if not e.enable:
        return
    if e.every == 0 and not e.at_end:
        raise ConfigError("eval.enable with eval.every = 0 and eval.at_end = false never evaluates; set one of them")
    limit_value(e.limit)
    p = cfg.parallelism
    unsupported = [
        f"{name} = {degree}" for name, degree in (
            ("parallelism.tensor_parallel_degree", p.tensor_parallel_degree),
            ("parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree),
            ("parallelism.context_parallel_degree", p.context_parallel_degree),
        ) if degree > 1
    ]
    if unsupported:
        raise ConfigError(
            f"eval.enable on {unsupported[0]}: evaluation runs on data-parallel layouts (FSDP, HSDP, DDP) for now; "
            "evaluate the saved checkpoint with ./run_eval.sh instead"
        )
