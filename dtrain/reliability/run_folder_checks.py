"""The run folder's paths, checked before anything starts: each problem is one line naming the path and the key.

Without these a run trains for an hour and then dies with a traceback at its first save or log line: the dump
folder is a file, or read-only; the checkpoint folder is a file; the metrics file is a folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from dtrain.config.schema import Checkpoint, Job
from dtrain.config.schema_observe import Metrics
from dtrain.errors import ConfigError


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_run_folder(job: Job, checkpoint: Checkpoint, metrics: Metrics) -> None:
    """Raise ConfigError if the run folder or a path the run writes inside it cannot be used."""
    run_dir = Path(job.dump_folder)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"job.dump_folder {run_dir} is a file; give a folder (it is created if missing)")
    existing = _nearest_existing(run_dir.absolute())
    if not existing.is_dir():
        raise ConfigError(f"job.dump_folder {run_dir}: {existing} is a file, so the folder cannot be created there")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is" if existing == run_dir.absolute() else f"would be created in {existing}, which is"
        raise ConfigError(f"job.dump_folder {run_dir} {what} not writable (read-only or another user's)")
    folders = {"checkpoint.folder": (checkpoint.folder, checkpoint.enable)}
    folders["metrics.save_tb_folder"] = (metrics.save_tb_folder, metrics.enable_tensorboard)
    for key, (name, used) in folders.items():
        path = run_dir / name
        if used and path.exists() and not path.is_dir():
            raise ConfigError(f"{key}: {path} is a file; remove it or set {key} to another name")
        if used and path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: {path} is not writable (read-only or another user's)")
    for name in ("config.toml", "metrics.jsonl"):
        path = run_dir / name
        if path.is_dir():
            raise ConfigError(f"{path} is a folder, where the run writes its {name}; remove or rename it")
