"""Run-folder problems are one line naming the path and the key, found before anything starts."""

from __future__ import annotations

import os

import pytest

from dtrain.config.schema import Checkpoint, Job, JobConfig
from dtrain.config.schema_observe import Metrics
from dtrain.errors import ConfigError
from dtrain.reliability.run_folder_checks import check_run_folder


def sections_for(run_dir, checkpoint: bool = True) -> tuple[Job, Checkpoint, Metrics]:
    """The [job], [checkpoint] and [metrics] sections check_run_folder reads."""
    cfg = JobConfig()
    cfg.job.dump_folder = str(run_dir)
    cfg.checkpoint.enable = checkpoint
    return cfg.job, cfg.checkpoint, cfg.metrics


def test_usable_folders_pass_existing_or_not(tmp_path):
    check_run_folder(*sections_for(tmp_path / "new" / "run"))
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    check_run_folder(*sections_for(tmp_path / "run"))


@pytest.mark.parametrize("make, message", [
    (lambda run: run.write_text("x"), "job.dump_folder {run} is a file; give a folder"),
    (lambda run: run.parent.write_text("x"), "job.dump_folder {run}: {parent}/p is a file"),
    (lambda run: (run.mkdir(), (run / "checkpoint").write_text("x")),
     "checkpoint.folder: {run}/checkpoint is a file; remove it or set checkpoint.folder to another name"),
    (lambda run: (run.mkdir(), (run / "tb").write_text("x")), "metrics.save_tb_folder: {run}/tb is a file"),
    (lambda run: (run / "metrics.jsonl").mkdir(parents=True),
     "{run}/metrics.jsonl is a folder, where the run writes its metrics.jsonl; remove or rename it"),
])
def test_each_problem_is_one_line_naming_the_path(tmp_path, make, message):
    run = tmp_path / "run"
    if "/p is a file" in message:
        run = tmp_path / "p" / "run"
    make(run)
    with pytest.raises(ConfigError) as err:
        check_run_folder(*sections_for(run))
    assert str(err.value).startswith(message.format(run=run, parent=tmp_path)) and "\n" not in str(err.value)


def test_a_read_only_folder_is_named(tmp_path, monkeypatch):
    # os.access is what a read-only mount answers (also for root, who may write anywhere else): simulate one.
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != os.fspath(tmp_path))
    with pytest.raises(ConfigError, match=f"job.dump_folder {tmp_path}/run would be created in {tmp_path}, "
                                          "which is not writable"):
        check_run_folder(*sections_for(tmp_path / "run"))
