"""What a tool that reads one checkpoint outside a run (scripts/convert_checkpoint.py, run_generate.sh) checks before
it reads a weight, so that it never turns a checkpoint into something else without a word:

- an uncommitted folder (`step-N.partial`, `.replaced`, `.deleting`) is refused, naming the newest committed step
  beside it: the commit protocol (folders.py) never loads one, whatever files it holds;
- a committed checkpoint's files are checked against its record (a damaged one is refused); a DCP folder without a
  record (from elsewhere) is read unverified, with one warning line;
- what the record says the checkpoint is (model family and args, LoRA rank, alpha, rsLoRA, targets) is what it is:
  a config that says otherwise is refused naming both values, never used to rebuild another model from its weights.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

from dtrain.checkpoint.config_checks import changed_model_args
from dtrain.checkpoint.folders import (
    COMMIT_FILE,
    CommitRecord,
    DamagedCheckpoint,
    is_dcp_checkpoint,
    is_leftover,
    read_record,
    scan_checkpoints,
)
from dtrain.checkpoint.lora_base import SETTINGS
from dtrain.config.values import show_value
from dtrain.errors import ConfigError, DtrainError

_LEFTOVER_KINDS = {
    ".partial": "a save that never finished",
    ".replaced": "an older copy being replaced",
    ".deleting": "a checkpoint being deleted by keep_latest_k",
}


def refuse_uncommitted(path: Path, label: str) -> None:
    """Refuse a leftover folder of the commit protocol; `label` is how the user named it (e.g. --checkpoint)."""
    if not is_leftover(path):
        return
    committed = scan_checkpoints(path.parent).committed
    latest = f"the latest committed one is {committed[-1].path}" if committed else "none beside it is committed"
    raise ConfigError(f"{label} {path} is uncommitted ({_LEFTOVER_KINDS[path.suffix]}) and is never loaded; {latest}")


def read_checkpoint_record(path: Path, label: str) -> CommitRecord | None:
    """The commit record of DCP checkpoint `path`, its files verified against it; None for a checkpoint from
    elsewhere, said in one warning line on stderr (a tool has no log)."""
    refuse_uncommitted(path, label)
    if not is_dcp_checkpoint(path):
        raise ConfigError(f"{label} {path} is not a DCP checkpoint folder (no .metadata)")
    if not (path / COMMIT_FILE).is_file():
        print(f"warning: {path} has no {COMMIT_FILE}: a checkpoint from elsewhere, read without checksums",
              file=sys.stderr)
        return None
    try:
        return read_record(path)
    except DamagedCheckpoint as err:
        raise DtrainError(f"checkpoint {path} is damaged: {err}") from None


def check_config_agrees(path: Path, record: CommitRecord | None, config: str, model: dict[str, Any], lora) -> None:
    """Refuse, naming both values, the first model or [lora] setting of `config` (a description of where the
    settings came from) that differs from what checkpoint `path` recorded; `model` is the config's
    config_checks.model_record, `lora` its [lora] section. A checkpoint without a record has nothing to contradict."""
    difference = next(_differences(record, model, lora), None) if record is not None else None
    if difference is not None:
        key, saved, ours = difference
        raise DtrainError(
            f"{config} has {key} = {ours}, but checkpoint {path} records {saved} (what it was trained with): "
            f"set {key} = {saved} there"
        )


def _differences(record: CommitRecord, model: dict[str, Any], lora) -> Iterator[tuple[str, str, str]]:
    """(key, recorded value, config's value) of each setting where the config differs from the record, shown as
    the config writes them."""
    saved = record.model
    if saved and model:
        if saved["name"] != model["name"]:
            yield "model.name", saved["name"], model["name"]
            return
        for key in changed_model_args(saved, model):
            yield f"model.args.{key}", show_value(saved["args"].get(key)), show_value(model["args"].get(key))
    trained = record.lora
    if trained and not lora.enable:
        yield "lora.enable", "true", "false"
    for key in SETTINGS if trained and lora.enable else ():
        if trained[key] != getattr(lora, key):
            yield f"lora.{key}", show_value(trained[key]), show_value(getattr(lora, key))
