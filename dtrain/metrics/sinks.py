"""Where logged metrics go besides the console: a JSON-lines file, TensorBoard event files and Weights & Biases."""

from __future__ import annotations

import json
import math
import os
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Mapping

from dtrain.errors import ConfigError


def _json_safe(value: Any) -> Any:
    """NaN and infinity are not JSON; write them as null so every line parses with any JSON reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlWriter:
    """Appends one JSON object per logged step to a file (appending, so a resumed run continues the same file)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({key: _json_safe(value) for key, value in record.items()}) + "\n")
        # Flushed per line so that `tail -f` and a crashed run both see every logged step.
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter:
    """Writes each numeric field of a record as a TensorBoard scalar tagged with the field's name."""

    def __init__(self, log_dir: Path):
        # Imported here: TensorBoard takes seconds to import and most processes (non-zero ranks, tests) never write.
        from torch.utils.tensorboard import SummaryWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def check_wandb_installed(enable_wandb: bool) -> None:
    """With metrics.enable_wandb, refuse at start-up (before the run folder is touched) when wandb is missing."""
    # find_spec, not an import: wandb takes seconds to import, and only the ranks that log need it.
    installed = sys.modules["wandb"] is not None if "wandb" in sys.modules else find_spec("wandb") is not None
    if enable_wandb and not installed:
        raise ConfigError(
            "metrics.enable_wandb = true needs the wandb package: pip install wandb, or set "
            "metrics.enable_wandb = false"
        )


class WandbWriter:
    """Logs each numeric field of a record to a Weights & Biases run at the record's step.

    The run is created here with the resolved config. WANDB_PROJECT names the project (default "dtrain"); wandb
    itself reads the rest of the user's WANDB_* settings (WANDB_MODE=offline, WANDB_ENTITY, WANDB_NAME,
    WANDB_RUN_ID, ...), which are left alone. Its files go under the run folder unless WANDB_DIR says otherwise.
    `rank` is given when every rank logs (metrics.save_for_all_ranks): each rank is then its own run, named after it.
    """

    def __init__(self, run_dir: Path, config: Mapping[str, Any], rank: int | None = None):
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        options: dict[str, Any] = {"project": os.environ.get("WANDB_PROJECT", "dtrain"), "config": dict(config)}
        if "WANDB_DIR" not in os.environ:
            options["dir"] = str(run_dir)
        if rank is not None:
            base = os.environ.get("WANDB_NAME", run_dir.name)
            options.update(name=f"{base}-rank{rank}", group=os.environ.get("WANDB_RUN_GROUP", base))
        self._run = wandb.init(**options)

    def write(self, step: int, record: dict[str, Any]) -> None:
        values = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
