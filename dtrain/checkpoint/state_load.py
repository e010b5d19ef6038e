"""Load a whole TrainState from a DCP checkpoint (a resume, or an initial load of a full state), resharding as
needed, after the checks that it can continue: data position, optimizer format and grouping, seed, groups."""

from __future__ import annotations

import logging
from pathlib import Path

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.config_checks import check_data_layout
from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.dcp_read import read_dcp
from dtrain.checkpoint.folders import CommitRecord
from dtrain.checkpoint.load_checks import fitting_weights
from dtrain.checkpoint.optimizer_checks import (
    check_grouping,
    check_optimizer,
    check_param_groups,
    group_settings,
    group_values,
    restore_group_settings,
)
from dtrain.checkpoint.spellings import model_fqns
from dtrain.checkpoint.weight_load import lora_weights
from dtrain.errors import DtrainError
from dtrain.step.optimizer import param_grouping

logger = logging.getLogger("dtrain")


def load_full_state(ctx: RunContext, path: Path, record: CommitRecord, adapters_only: bool = False) -> None:
    """Load the whole TrainState from `path` except checkpoint.exclude_from_loading, resharding as needed (of the
    weights only the LoRA adapters when `adapters_only`)."""
    state = ctx.state
    exclude = set(ctx.checkpoint.exclude_from_loading)
    if "dataloader" not in exclude:
        check_data_layout(ctx, path, record)
    if "optimizer" not in exclude:
        check_optimizer(path, record.optimizer, ctx.optimizer.name)
        check_grouping(path, record.optimizer_grouping, param_grouping(ctx.optimizer))
    current = state.state_dict()
    shapes = dcp_io.read_tensor_shapes(path)
    current[dcp_io.MODEL_KEY] = lora_weights(current[dcp_io.MODEL_KEY], shapes, f"{dcp_io.MODEL_KEY}.", adapters_only)
    # The optimizer's state is per weight, so a whole state loads only into the model it was saved from.
    fitting_weights(path, shapes, f"{dcp_io.MODEL_KEY}.", current[dcp_io.MODEL_KEY],
                    model_fqns(current[dcp_io.MODEL_KEY], ctx.group), lambda fqn: fqn, partial=False,
                    way_out="a whole training state loads only into the model it was saved from")
    dcp_io.check_weights_fit(path, shapes, f"{dcp_io.MODEL_KEY}.", current[dcp_io.MODEL_KEY])
    wanted = {k: v for k, v in current.items() if k not in exclude}
    ours, settings = group_values(current[dcp_io.OPTIMIZER_KEY]), group_settings(state.optimizer)
    read_dcp(wanted, path)
    saved_seed = wanted["train"]["seed"]
    seed = state.setup.seed
    if saved_seed != seed:
        raise DtrainError(
            f"checkpoint {path} was trained with debug.seed = {saved_seed}, this run has debug.seed = {seed}; "
            f"set --debug.seed {saved_seed} (seed and step are the run's random state)"
        )
    if "optimizer" not in exclude:
        # Before the state takes them: the load itself would put the checkpoint's hyperparameters in place.
        vectors = {fqn for fqn, weight in current[dcp_io.MODEL_KEY].items() if weight.ndim < 2}
        check_param_groups(path, record.optimizer_grouping, ctx.optimizer, ours,
                           wanted[dcp_io.OPTIMIZER_KEY], vectors)
    state.load_state_dict({**current, **wanted})
    restore_group_settings(state.optimizer, settings)
    if "optimizer" in exclude:
        # Reading the optimizer's state dict made DCP initialise it with one zero-gradient step; a fresh optimizer
        # has no state at all, so drop it (Adam's bias correction counts from its first real step).
        state.optimizer.state.clear()
    if exclude:
        logger.info(f"checkpoint: not loaded (checkpoint.exclude_from_loading): {', '.join(sorted(exclude))}")
