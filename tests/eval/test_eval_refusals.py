"""[eval] and run_eval.sh refuse bad input in one line before anything runs: an unknown task (with the nearest
names), a task whose data file is not on disk (with the paths looked for), a limit that is not a number or a whole
count, a layout the backend does not evaluate on; and a task folder's relative data_files resolve beside its YAML."""

from __future__ import annotations

import pytest

from dtrain.config import load_config
from dtrain.errors import ConfigError

pytest.importorskip("lm_eval")


def test_unknown_task_names_the_nearest_ones():
    from dtrain.eval.tasks import resolve_tasks

    with pytest.raises(ConfigError, match=r"unknown task 'dtrain_tiny_choise' \(nearest: dtrain_tiny_choice"):
        resolve_tasks(["dtrain_tiny_choise"], [])


def test_task_data_is_resolved_beside_its_yaml_or_refused_with_the_paths(tmp_path):
    from dtrain.eval.tasks import resolve_tasks

    (tmp_path / "mine.yaml").write_text(
        "task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: rows.jsonl\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
    )
    with pytest.raises(ConfigError, match=f"task my_task: data file rows.jsonl is not on disk .*{tmp_path}/rows.jsonl"):
        resolve_tasks(["my_task"], [str(tmp_path)])
    (tmp_path / "rows.jsonl").write_text('{"text": "hello"}\n')
    (spec,) = resolve_tasks(["my_task"], [str(tmp_path)]).specs
    assert spec["dataset_kwargs"]["data_files"] == {"test": str(tmp_path / "rows.jsonl")}


@pytest.mark.parametrize("argv, message", [
    (["--eval.limit", "abc"], "eval.limit expects a number, got 'abc'"),
    (["--eval.limit", "2.5"], "eval.limit = 2.5: a count of documents is a whole number"),
    (["--eval.every", "0", "--eval.no_at_end"], "never evaluates"),
    (["--parallelism.tensor_parallel_degree", "2"], "eval.enable on parallelism.tensor_parallel_degree = 2"),
])
def test_config_refusals(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--eval.enable", *argv])
