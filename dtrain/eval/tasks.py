"""Which tasks an evaluation runs, found by the harness's TaskManager, and refused in one line before anything runs.

Tasks come from the tiny set bundled in tasks/ (for the debug model: `dtrain_tiny_choice`, `dtrain_tiny_text`,
`dtrain_tiny_arithmetic`, or all as `dtrain_tiny`), from folders of the user's task YAMLs (`task_paths`), and from
the harness's own index (read only when a name is in neither: indexing its thousands of YAMLs takes seconds).

A task YAML that reads local files (`dataset_path: json|csv|parquet|text|arrow` with `data_files`) may name them
relative to its own folder: they are resolved there before the harness loads the task (datasets would resolve
them against the working directory), so that bundled and user tasks run from anywhere. Such files must exist: a
missing one is refused with the path looked for, as is an unknown task name (with the nearest known names).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import ConfigError

BUNDLED = Path(__file__).resolve().parent / "tasks"
BUNDLED_GROUP = "dtrain_tiny"
BUNDLED_TASKS = ("dtrain_tiny_choice", "dtrain_tiny_text", "dtrain_tiny_arithmetic")
LOCAL_FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


@dataclass
class ResolvedTasks:
    """What the harness's simple_evaluate takes: task names or configs with their files resolved, and the
    TaskManager that knows them."""

    specs: list[Any]
    manager: Any


def require_harness(what: str) -> None:
    """One line, not an ImportError, when lm-evaluation-harness (the `eval` extra) is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs lm-evaluation-harness, dtrain's `eval` extra: DTRAIN_EXTRAS=eval "
                          "./scripts/setup_env.sh (or pip install -e '.[eval]' in your own environment)") from None


def _manager(task_paths: list[str], with_harness_tasks: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(BUNDLED), *task_paths], include_defaults=with_harness_tasks)


def resolve_tasks(names: list[str], task_paths: list[str], key: str = "eval.tasks") -> ResolvedTasks:
    """The tasks `names` (a bundled or harness task, group or tag, or one in `task_paths`), their local data
    checked; ConfigError naming `key` otherwise."""
    require_harness(key)
    if not names:
        raise ConfigError(f"{key} is empty; name at least one task (e.g. {BUNDLED_GROUP})")
    for path in task_paths:
        if not Path(path).is_dir():
            raise ConfigError(f"eval.task_paths: {path} is not a folder (it should hold task YAML files)")
    # The bundled set by one name; expanded here, not by a group YAML, so that each task's files get resolved.
    names = [task for name in names for task in (BUNDLED_TASKS if name == BUNDLED_GROUP else (name,))]
    manager = _manager(task_paths, with_harness_tasks=False)
    if any(name not in manager.all_tasks for name in names):
        manager = _manager(task_paths, with_harness_tasks=True)
    for name in names:
        if name not in manager.all_tasks:
            nearest = difflib.get_close_matches(name, [*manager.all_tasks, BUNDLED_GROUP], n=3, cutoff=0.5)
            hint = f"nearest: {', '.join(nearest)}" if nearest else f"e.g. {BUNDLED_GROUP}, hellaswag, mmlu"
            raise ConfigError(
                f"{key}: unknown task {name!r} ({hint}; or add the folder of its YAML to eval.task_paths or "
                "--task_paths)"
            )
    return ResolvedTasks([_with_local_files(manager, name) for name in names], manager)


def _with_local_files(manager, name: str) -> Any:
    """`name`, or for a task whose YAML reads local files, its config with those files resolved and checked."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from lm_eval.tasks._index import Kind

    entry = manager.task_index[name]
    if entry.kind != Kind.TASK or entry.yaml_path is None:  # a group or tag: the harness expands it
        return name
    config = load_yaml(entry.yaml_path, resolve_func=True)
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if config.get("dataset_path") not in LOCAL_FILE_BUILDERS or not files:
        return name
    folder = Path(entry.yaml_path).parent
    resolved = _resolved(files, folder, name)
    config["dataset_kwargs"] = {**config["dataset_kwargs"], "data_files": resolved}
    return config


def _resolved(files: Any, folder: Path, task: str) -> Any:
    """`data_files` (a path, a list of them, or a split -> paths dict) with relative paths taken from the task's
    folder when the file is there, else as given (the working directory); each must exist."""
    if isinstance(files, dict):
        return {split: _resolved(paths, folder, task) for split, paths in files.items()}
    if isinstance(files, list):
        return [_resolved(path, folder, task) for path in files]
    path = Path(files)
    beside = folder / path
    if not path.is_absolute() and beside.exists():
        return str(beside)
    if not path.exists():
        looked = str(path) if path.is_absolute() else f"{beside} or {path.resolve()}"
        raise ConfigError(f"task {task}: data file {files} is not on disk (looked for {looked})")
    return str(path)
