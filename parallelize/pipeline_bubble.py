"""The pipeline bubble each schedule implies: the share of a step a rank sits idle, under ideal timing.

Ideal timing: per microbatch, a rank's forward takes 1 unit and its backward 2 (input gradients 1, weight
gradients 1), split evenly over its ``v`` stages; communication is free. With ``p`` pipeline ranks and ``m``
microbatches a rank works ``3m`` units per step; if the step takes ``T``, the bubble is ``1 - 3m / T``:
GPipe and 1F1B ``T = 3(m + p - 1)``; Interleaved1F1B and LoopedBFS ``T = max(3m + 3(p-1)/v, 3p)``; the
zero-bubble and V schedules (v = 2 for V) ``T = max(3m + (p-1)/v, 2p + 1/v)``, the second term being one
microbatch's chain. The closed forms, what they mean for choosing a schedule, and why real timings differ:
docs/parallelism.md, "Schedules".
"""

from __future__ import annotations

from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.pipeline_plan import (
    PIPELINE_SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    V_SCHEDULES,
    PipelinePlan,
    check_microbatches,
)


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int) -> float:
    """The idle share of a step (0 to 1) for `schedule` with these sizes, under the module doc's ideal timing."""
    p, m, v = pp, n_microbatches, stages_per_rank
    if schedule in SINGLE_STAGE_SCHEDULES:
        step_time = 3 * (m + p - 1)
    elif schedule in ("Interleaved1F1B", "LoopedBFS"):
        step_time = max(3 * m + 3 * (p - 1) / v, 3 * p)
    elif schedule in SPLIT_BACKWARD_SCHEDULES:
        step_time = max(3 * m + (p - 1) / v, 2 * p + 1 / v)
    else:
        raise ParallelismError(f"unknown pipeline schedule {schedule!r} (valid: {', '.join(PIPELINE_SCHEDULES)})")
    return 1 - 3 * m / step_time


def _stages_per_rank(schedule: str, plan: PipelinePlan) -> int:
    """What `schedule` would run per rank in place of the plan's schedule."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return 1
    if schedule in V_SCHEDULES:
        return 2
    return plan.stages_per_rank if plan.stages_per_rank > 1 else 2


def format_bubbles(plan: PipelinePlan) -> str:
    """One log line comparing every schedule's bubble for the plan's ranks and microbatches; ``*`` marks the
    configured schedule, ``n/a`` a schedule that cannot run this many microbatches."""
    entries = []
    for schedule in PIPELINE_SCHEDULES:
        v = _stages_per_rank(schedule, plan)
        try:
            check_microbatches(schedule, plan.pp, plan.pp * v, plan.n_microbatches, "")
            value = f"{100 * bubble_fraction(schedule, plan.pp, plan.n_microbatches, v):.1f}%"
        except ParallelismError:
            value = "n/a"
        mark = "*" if schedule == plan.schedule else ""
        entries.append(f"{mark}{schedule}{f' (v={v})' if v > 1 else ''} {value}")
    return (
        f"pipeline bubble (idle share of a step; p={plan.pp}, m={plan.n_microbatches}, ideal timing): "
        + ", ".join(entries)
    )
