"""One evaluation: the harness's simple_evaluate over the backend, its metrics as `eval/<task>/<metric>`, and its
results JSON (the harness's own dict, as `lm_eval --output_path` writes it) in a folder.

Every rank runs this with the same tasks and gets the same results (backend.py gathers every answer on every rank);
only rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dtrain.eval.backend import DtrainLM
from dtrain.eval.tasks import ResolvedTasks

logger = logging.getLogger("dtrain")
RESULTS_FILE = "eval_results.json"


@dataclass(frozen=True)
class Evaluation:
    """What to evaluate: resolved tasks, few-shot examples (None: each task's own default), `limit` (a number of
    documents per task, or a fraction below 1 of them; None: all), and whether the results keep every sample."""

    tasks: ResolvedTasks
    num_fewshot: int | None = None
    limit: float | None = None
    log_samples: bool = False
    bootstrap_iters: int = 1000


def evaluate(lm: DtrainLM, evaluation: Evaluation) -> tuple[dict[str, Any], float]:
    """The harness's results dict, and the seconds it took."""
    from lm_eval.evaluator import simple_evaluate

    started = time.perf_counter()
    results = simple_evaluate(
        model=lm, tasks=evaluation.tasks.specs, task_manager=evaluation.tasks.manager,
        num_fewshot=evaluation.num_fewshot, limit=evaluation.limit, log_samples=evaluation.log_samples,
        bootstrap_iters=evaluation.bootstrap_iters,
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # The harness returns its results only where LOCAL_RANK is 0 (its tensor-parallel convention); every rank
        # computed the same ones, so rank 0's are every rank's.
        shared = [results]
        dist.broadcast_object_list(shared, src=0)
        results = shared[0]
    return results, time.perf_counter() - started


def task_metrics(results: dict[str, Any]) -> dict[str, float]:
    """`eval/<task>/<metric>` (and `..._stderr`) of each task's numeric results; the harness's keys are
    `<metric>,<filter>`, and the filter is named only when it is not the default ("none")."""
    metrics = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            if not math.isnan(value):
                metrics[f"eval/{task}/{name}"] = float(value)
    return metrics


def write_results(results: dict[str, Any], folder: Path) -> Path:
    """The harness's results (samples too, when kept) as JSON in `folder`."""
    from lm_eval.utils import handle_non_serializable

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RESULTS_FILE
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    return path
