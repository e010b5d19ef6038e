"""metrics.enable_wandb: a Weights & Biases sink beside metrics.jsonl, tested against a fake `wandb` module (no
package, no network), and the one-line start-up error when wandb is not installed."""

import os
import sys
import types
from pathlib import Path

import pytest
import torch

from dtrain.errors import ConfigError
from dtrain.metrics.logger import MetricsLogger
from dtrain.metrics.sinks import check_wandb_installed
from dtrain.run.prepare import prepare

CPU = torch.device("cpu")


class FakeWandb(types.ModuleType):
    """Records wandb.init's arguments and every call on the runs it returns."""

    def __init__(self):
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, **options):
        self.calls.append(("init", options))
        calls = self.calls

        class Run:
            def log(self, values, step):
                calls.append(("log", values, step))

            def finish(self):
                calls.append(("finish",))

        return Run()


@pytest.fixture
def fake_wandb(monkeypatch):
    module = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", module)
    for name in ("WANDB_PROJECT", "WANDB_DIR", "WANDB_NAME", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(name, raising=False)
    return module


def metrics_logger(cfg, rank=0, run_config=None) -> MetricsLogger:
    return MetricsLogger(cfg.metrics, cfg.job.dump_folder, cfg.training.steps, rank, 2, 1e6, CPU, torch.float32,
                         run_config=run_config)


def test_rank0_logs_every_record_to_a_wandb_run_with_the_config(cfg, fake_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg.metrics.enable_wandb = True
    cfg.metrics.enable_tensorboard = False
    with metrics_logger(cfg, run_config={"training": {"steps": 100}}) as ml:
        ml.log(1, {"loss": torch.tensor(2.5), "grad_norm": torch.tensor(1.0), "lr": 1e-3}, 64)
        ml.log(10, {"loss": torch.tensor(2.0), "grad_norm": torch.tensor(0.5), "lr": 1e-3, "extra": 7.0}, 640)
    (_, options), (_, first, step1), (_, second, step10), finish = fake_wandb.calls
    assert options == {"project": "dtrain", "config": {"training": {"steps": 100}}, "dir": cfg.job.dump_folder}
    assert (step1, step10, finish) == (1, 10, ("finish",))
    assert first["loss"] == 2.5 and first["lr"] == 1e-3 and "step" not in first
    assert "mfu" not in first  # None on CPU (no known peak): not a number, so not logged
    assert second["extra"] == 7.0 and second["tokens_seen"] == 704
    assert os.environ["WANDB_MODE"] == "offline"  # the user's mode is wandb's to read, untouched


def test_validation_records_reach_wandb_too(cfg, fake_wandb):
    cfg.metrics.enable_wandb = True
    with metrics_logger(cfg) as ml:
        ml.log_validation(10, {"val_loss": 2.0, "val_perplexity": 7.389})
    assert fake_wandb.calls[1] == ("log", {"val_loss": 2.0, "val_perplexity": 7.389}, 10)


def test_user_project_and_dir_are_respected(cfg, fake_wandb, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    cfg.metrics.enable_wandb = True
    metrics_logger(cfg).close()
    options = fake_wandb.calls[0][1]
    assert options["project"] == "mine" and "dir" not in options  # wandb reads WANDB_DIR itself


def test_only_rank0_logs_unless_every_rank_saves(cfg, fake_wandb):
    cfg.metrics.enable_wandb = True
    metrics_logger(cfg, rank=1).close()
    assert fake_wandb.calls == []
    cfg.metrics.save_for_all_ranks = True
    metrics_logger(cfg, rank=1).close()
    options = fake_wandb.calls[0][1]
    assert (options["name"], options["group"]) == ("run-rank1", "run")


def test_disabled_wandb_is_never_imported(cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would fail
    metrics_logger(cfg).close()


def test_missing_wandb_is_one_line_naming_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    check_wandb_installed(False)
    with pytest.raises(ConfigError, match=r"^metrics.enable_wandb = true needs the wandb package: pip install wandb, "
                                          r"or set metrics.enable_wandb = false$"):
        check_wandb_installed(True)


def test_missing_wandb_refuses_before_the_run_folder_exists(cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg.metrics.enable_wandb = True
    cfg.model.tokenizer = "byte"
    with pytest.raises(ConfigError, match="metrics.enable_wandb"):
        prepare(cfg)
    assert not Path(cfg.job.dump_folder).exists()
