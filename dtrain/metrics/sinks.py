"""Where logged metrics go besides the console: a JSON-lines file and TensorBoard event files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


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
