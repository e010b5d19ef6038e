"""Read the planned checkpoint into the model or the whole state, by what the plan reads: one reader per source, so
a new kind of checkpoint is one more reader here (and its choice in startup_plan.py), not a branch in the start-up."""

from __future__ import annotations

from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.spellings import family_spellings
from dtrain.checkpoint.startup_plan import Plan
from dtrain.checkpoint.state_load import load_full_state
from dtrain.checkpoint.weight_load import load_weights


def read_hf_weights(ctx: RunContext, plan: Plan) -> None:
    from dtrain.checkpoint.hf_io import build_adapter, load_hf_weights

    load_hf_weights(ctx.state.model_parts, plan.path, build_adapter(ctx.model.name, ctx.model_args), ctx.group)


def read_dcp_weights(ctx: RunContext, plan: Plan) -> None:
    # Only a checkpoint from elsewhere (no commit record) may spell the weights otherwise; dtrain's are ours.
    spellings = family_spellings(ctx.model.name, ctx.model_args) if plan.foreign else ()
    writer = ctx.checkpoint.initial_load_writer if plan.foreign else "dtrain"
    partial = plan.rule == "initial_load" and ctx.checkpoint.initial_load_partial
    load_weights(ctx, plan.path, spellings, writer, adapters_only=plan.lora_base is not None, partial=partial)


def read_dcp_state(ctx: RunContext, plan: Plan) -> None:
    load_full_state(ctx, plan.path, plan.record, adapters_only=plan.lora_base is not None)


READERS = {"hf": read_hf_weights, "weights": read_dcp_weights, "state": read_dcp_state}


def read_checkpoint(ctx: RunContext, plan: Plan) -> None:
    READERS[plan.reads](ctx, plan)


def continue_finished_run(ctx: RunContext, plan: Plan) -> None:
    """A finished run's final model-only save: nothing is left to train, so only the counters move."""
    if plan.model_only and plan.rule == "resume" and plan.record is not None and plan.record.step > 0:
        ctx.state.step, ctx.state.tokens_seen = plan.record.step, plan.record.tokens_seen
