"""Resume checks of the optimizer's parameter groups: the grouping (optimizer.no_decay_on_vectors) and the
hyperparameters a checkpoint carries in them (weight_decay, betas, eps; lr is the LR schedule's).

Loading an optimizer state dict puts every group's hyperparameters back from the checkpoint (torch's rule). DCP's
flattened state stores them per parameter and gives each of this run's groups the values of its first parameter,
so a changed config would silently not apply, and a checkpoint of two groups would load into one group with the
first group's weight decay. torchtitan 0.2.2 keeps the checkpoint's values without a word; dtrain keeps them too
(the same numbers), but only where this run's config agrees: any difference is refused in one line. The groups'
other settings (how optimizer.name and optimizer.implementation step) are put back to this run's after the load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dtrain.config.low_bit_optim import low_bit_suffix
from dtrain.config.schema import Optimizer as OptimizerConfig
from dtrain.errors import DtrainError
from dtrain.step.optimizer import param_grouping

logger = logging.getLogger("dtrain")
GROUPS_PREFIX = "param_groups."
FRESH_OPTIMIZER = 'checkpoint.exclude_from_loading = ["optimizer"] to start the optimizer afresh'
GROUPINGS = {
    "all": "one parameter group, every parameter decayed",
    "no_decay_on_vectors": "two parameter groups, 1-D parameters not decayed",
}


def group_values(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """The per-parameter group entries ("param_groups.<fqn>.<key>") of a flattened optimizer state dict, copied
    (a load replaces them in place)."""
    return {k: v for k, v in optimizer_state.items() if k.startswith(GROUPS_PREFIX)}


def check_grouping(path: Path, saved: str, ours: str) -> None:
    """Refuse a checkpoint whose parameter grouping (dtrain.step.optimizer.param_grouping) is not this run's."""
    if not saved or saved == ours:
        return
    raise DtrainError(
        f"checkpoint {path} was saved with optimizer.no_decay_on_vectors = {_flag(saved)} "
        f"({GROUPINGS.get(saved, saved)}), this run has {_flag(ours)}, which a resume cannot apply to its optimizer "
        f"state: set optimizer.no_decay_on_vectors = {_flag(saved)}, or {FRESH_OPTIMIZER}"
    )


def check_param_groups(
    path: Path, recorded: str, cfg: OptimizerConfig, ours: dict[str, Any], saved: dict[str, Any], vectors: set[str]
) -> None:
    """Refuse a checkpoint whose parameter groups (`saved`, as loaded) hold other hyperparameters than this run's
    (`ours`, as built from `cfg`); `vectors` are the FQNs of the 1-D parameters.

    A record without the grouping (`recorded` empty) is read from the per-parameter weight decay itself, not
    assumed: checkpoints from before optimizer.no_decay_on_vectors existed have two groups, but those written by
    the first version with the option have either, and the stored decays are what a resume would apply.
    """
    if not recorded:  # a recorded grouping was checked before loading
        check_grouping(path, _stored_grouping(saved, vectors), param_grouping(cfg))
    for key, value in ours.items():
        fqn, _, name = key[len(GROUPS_PREFIX):].rpartition(".")
        if name in ("weight_decay", "eps") and _floats(saved[key]) != _floats(value):
            _refuse(path, name, saved[key], value, fqn)
        if name == "betas":
            for index, (stored, own) in enumerate(zip(_floats(saved[key]), _floats(value), strict=True)):
                if stored != own:
                    _refuse(path, f"beta{index + 1}", stored, own, fqn)


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings besides its parameters and learning rate, as this run built them."""
    return [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]


def restore_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    """Give the loaded groups back this run's `settings` (group_settings). The checked hyperparameters are equal
    already; what else a load puts back is how this run's optimizer.name and optimizer.implementation step:
    decoupled_weight_decay (torch's Adam and AdamW are one class, so AdamW's state would go on stepping as AdamW
    in Adam) and the kernel flags (a fused state would stay fused on a CPU run that asked for foreach)."""
    changed = set()
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        changed |= {k for k, v in own.items() if group.get(k) != v}
        group.update(own)
    if changed:
        logger.info(f"checkpoint: the optimizer's {', '.join(sorted(changed))} are this run's, not the checkpoint's")


def _stored_grouping(saved: dict[str, Any], vectors: set[str]) -> str:
    """The grouping that the stored weight decays show: "no_decay_on_vectors" where the 1-D parameters' differs
    from the others', "all" where every parameter has the same nonzero one, "" where none decays (either grouping
    then applies the same decay) or the model has no 1-D parameters."""
    decays = {key[len(GROUPS_PREFIX):].removesuffix(".weight_decay"): _floats(v)
              for key, v in saved.items() if key.endswith(".weight_decay")}
    of_vectors = {d for fqn, d in decays.items() if fqn in vectors}
    of_others = {d for fqn, d in decays.items() if fqn not in vectors}
    if not of_vectors or not of_others or of_vectors == of_others == {(0.0,)}:
        return ""
    return "no_decay_on_vectors" if of_vectors != of_others else "all"


def _refuse(path: Path, key: str, saved: Any, ours: Any, fqn: str) -> None:
    raise DtrainError(
        f"checkpoint {path} holds optimizer state with optimizer.{key} = {_number(saved)} (for {fqn}), this run has "
        f"{_number(ours)}, which a resume cannot apply (the checkpoint's would silently stay, as in torchtitan): set "
        f"optimizer.{key} = {_number(saved)}, or {FRESH_OPTIMIZER} with this run's"
    )


def _floats(value: Any) -> tuple[float, ...]:
    """A hyperparameter as floats (torchao keeps some as tensors; betas are a pair)."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(float(v) for v in values)


def _number(value: Any) -> str:
    return ", ".join(f"{v:g}" for v in _floats(value))


def _flag(grouping: str) -> str:
    return str(grouping == "no_decay_on_vectors").lower()


def check_optimizer(path: Path, saved: str, ours: str) -> None:
    """Refuse optimizer state stored in another moment format (torch's float moments, torchao's 8-bit, 4-bit or
    float8 ones): DCP would load float moments into a low-bit optimizer whole, silently undoing its memory saving,
    and fail on the reverse with a message about metadata. Optimizers of one format (AdamW and Adam) share their
    state, so switching between them continues it, said in the log."""
    if not saved or saved == ours:  # "": a record from before dtrain recorded it
        return
    if low_bit_suffix(saved) != low_bit_suffix(ours):
        raise DtrainError(
            f"checkpoint {path} holds the optimizer state of optimizer.name = {saved} ({_moments(saved)} moments), "
            f"which {ours} ({_moments(ours)} moments) cannot continue: set optimizer.name = {saved}, or "
            'checkpoint.exclude_from_loading = ["optimizer"] to start the optimizer afresh'
        )
    logger.info(f"checkpoint: optimizer state saved by {saved} continues in {ours} (the same moment format)")


def _moments(name: str) -> str:
    return low_bit_suffix(name) or "float"
