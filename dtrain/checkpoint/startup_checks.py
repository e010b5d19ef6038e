"""The checks before a start-up load reads anything: what a resume may not change, and a tying that would merge or
duplicate weights; a load into another layout is said in the log (DCP reshards)."""

from __future__ import annotations

import logging

from dtrain.checkpoint.config_checks import check_resume_changes
from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.load_checks import check_tying
from dtrain.checkpoint.lora_base import check_lora_settings
from dtrain.checkpoint.startup_plan import Plan

logger = logging.getLogger("dtrain")


def check_before_loading(ctx: RunContext, plan: Plan) -> None:
    record = plan.record
    if record is None:  # a checkpoint from elsewhere records nothing to check against
        return
    if plan.rule == "resume":
        check_resume_changes(ctx, plan.path, record)  # another model, seq_len or batch: config_checks.py says why
        check_lora_settings(plan.path, record.lora, ctx.lora)
    check_tying(plan.path, record, ctx.model_args)
    if (record.world_size, record.parallelism) != (ctx.world_size, ctx.parallel_degrees()):
        logger.info(
            f"checkpoint: saved by {record.world_size} rank(s) with {_degrees(record.parallelism)}, loading into "
            f"{ctx.world_size} with {_degrees(ctx.parallel_degrees())}: DCP reshards"
        )


def _degrees(parallelism: dict) -> str:
    shown = {k.replace("_parallel", "").replace("_degree", ""): v for k, v in parallelism.items() if v != 1}
    return ", ".join(f"{k} {v}" for k, v in shown.items()) or "no parallelism"
