"""The start-up rule: resume the run directory's checkpoint, else restore checkpoint.initial_load_path, else start
from scratch (or fail, with checkpoint.require_checkpoint). Rank 0 decides; every rank then loads.

The restore is a pipeline of stages, each in its own file: find what to load (startup_plan.py) -> check it may load
(startup_checks.py) -> a LoRA run's frozen base (lora_start.py) -> read it, names mapped from other writers'
spellings (checkpoint_readers.py) -> the adapters (lora_start.py) -> transforms of the loaded model (post_load.py).
docs/checkpointing.md gives the rule in full.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dtrain.checkpoint.checkpoint_readers import continue_finished_run, read_checkpoint
from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.dcp_read import LoadFailed
from dtrain.checkpoint.lora_start import load_lora_base, start_lora
from dtrain.checkpoint.post_load import quantize_qlora_base
from dtrain.checkpoint.startup_checks import check_before_loading
from dtrain.checkpoint.startup_plan import FALLBACK_HINT, Plan, choose_plan

logger = logging.getLogger("dtrain")

# Each stage takes (ctx, plan) and passes over a plan that does not concern it: a new source is one reader, a new
# transform one entry of AFTER_LOAD, not another branch here.
LOAD_STAGES = (check_before_loading, load_lora_base, read_checkpoint, start_lora, continue_finished_run)
# What runs on the model whichever rule fired (scratch included), once the load has succeeded.
AFTER_LOAD = (quantize_qlora_base,)


@dataclass(frozen=True)
class Startup:
    """What restore_at_startup did: the rule that fired ("resume", "initial_load", "scratch"), from where, and
    the step training continues after."""

    rule: str
    step: int = 0
    path: Path | None = None
    model_only: bool = False

    def describe(self) -> str:
        if self.rule == "scratch":
            return "checkpoint: starting from scratch (no checkpoint to resume, no checkpoint.initial_load_path)"
        what = "weights only" if self.model_only else "full training state"
        if self.rule == "resume":
            return f"checkpoint: resuming from {self.path} ({what}) at step {self.step}"
        return f"checkpoint: initial load from {self.path} ({what}); continuing as a new run at step {self.step}"


def restore_at_startup(ctx: RunContext) -> Startup:
    """Apply the start-up rule to `ctx.state`, log which rule fired, and return it. Errors are one-line DtrainErrors."""
    startup = _load_with_fallback(ctx)
    for transform in AFTER_LOAD:
        transform(ctx)
    logger.info(startup.describe())
    if startup.rule == "resume" and startup.step >= ctx.training.steps:
        logger.info(f"checkpoint: the run already reached training.steps = {ctx.training.steps}; nothing to train")
    return startup


def _load_with_fallback(ctx: RunContext) -> Startup:
    """Plan and load; a resume whose checkpoint fails to read falls back to the one before it where allowed."""
    failed: set[Path] = set()
    while True:
        plan = ctx.agree(lambda: choose_plan(ctx, failed))
        for note in plan.notes:
            logger.warning(note)
        if plan.rule == "scratch":
            return Startup("scratch")
        try:
            _load(ctx, plan)
        except LoadFailed as err:
            c = ctx.checkpoint
            if plan.rule == "resume" and c.fallback_to_previous and c.load_step < 0:
                logger.warning(f"{err}; falling back to the previous complete checkpoint")
                failed.add(plan.path)
                continue
            hint = f"; {FALLBACK_HINT}" if plan.rule == "resume" and c.load_step < 0 else ""
            raise LoadFailed(f"{err}{hint}") from None
        return Startup(plan.rule, ctx.state.step, plan.path, plan.model_only)


def _load(ctx: RunContext, plan: Plan) -> None:
    for stage in LOAD_STAGES:
        stage(ctx, plan)
