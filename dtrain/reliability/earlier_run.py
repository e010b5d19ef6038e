"""One run, one metrics file: a new run in a folder that holds an earlier run's metrics starts files of its own.

A run that resumes a checkpoint continues its run's files, as does a replica group rejoining its job (fault
tolerance: it continues the job's run, live). Any other run in such a folder would append its steps to the earlier
run's (`1..40 1 3` in one metrics.jsonl, two curves in one TensorBoard folder), so the earlier run's metrics, its
TensorBoard folder and its config.toml move to `<dump_folder>/earlier_runs/<time>/` first, said in one line.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from dtrain.config.schema_observe import Metrics

logger = logging.getLogger("dtrain")
EARLIER_RUNS = "earlier_runs"


def set_aside_earlier_run(run_dir: Path, metrics: Metrics, continues_a_run: bool) -> Path | None:
    """Move an earlier run's files out of the way (rank 0, before the run writes its own); the folder they went to,
    or None when there was nothing to move or this run continues that one."""
    records = [run_dir / "metrics.jsonl", *sorted(run_dir.glob("metrics_rank*.jsonl"))]
    if continues_a_run or not any(path.is_file() for path in records):
        return None
    steps = logged_steps(run_dir / "metrics.jsonl")
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S")
    target, again = run_dir / EARLIER_RUNS / stamp, 1
    while target.exists():  # two runs started within the same second
        target, again = run_dir / EARLIER_RUNS / f"{stamp}.{again}", again + 1
    target.mkdir(parents=True)
    for path in [*records, run_dir / metrics.save_tb_folder, run_dir / "config.toml"]:
        if path.exists():
            path.rename(target / path.name)
    what = f"steps {steps[0]}..{steps[-1]}" if steps else "no step logged"
    logger.info("%s held an earlier run's metrics (%s) and this run resumes nothing: they are in %s now",
                run_dir, what, target)
    return target


def logged_steps(path: Path) -> list[int]:
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):  # a line cut short by a killed run, or a record without a step
            continue
    return steps
