"""Exact resume (sync and async saves), retention, finished runs, model-only saves and the seed checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch
from checkpoint_helpers import TINY_ARGS, make_cfg, manager_for, tiny_state, train

from dtrain.checkpoint import scan_checkpoints
from dtrain.checkpoint.folders import read_record
from dtrain.config import JobConfig
from dtrain.errors import DtrainError
from dtrain.models.llama3 import Transformer
from dtrain.step.rng import seed_everything


def reference_losses(cfg, steps=6):
    return train(tiny_state(cfg), None, steps, cfg)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_after_a_crash_continues_bit_identically(run_dir, async_mode):
    cfg = make_cfg(run_dir, async_mode=async_mode)
    expected = reference_losses(cfg)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    assert manager.restore_at_startup().rule == "scratch"
    assert train(state, manager, 5, cfg) == expected[:5]
    manager.close()  # what a crash leaves: step-2 and step-4 committed, step 5 lost

    state = tiny_state(cfg)
    startup = manager_for(cfg, state).restore_at_startup()
    assert (startup.rule, startup.step, startup.path.name) == ("resume", 4, "step-4")
    assert state.tokens_seen == 4 * 2 * 16 and state.lr_scheduler.last_epoch == 4
    assert train(state, None, 6, cfg) == expected[4:]


def test_finished_run_is_not_trained_again_and_longer_run_resumes_from_full_state(run_dir, caplog):
    cfg = make_cfg(run_dir, steps=6)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    manager.restore_at_startup()
    train(state, manager, 6, cfg)
    manager.close()
    assert read_record(run_dir / "checkpoint" / "step-6").kind == "model_only"

    again = tiny_state(cfg)
    startup = manager_for(cfg, again).restore_at_startup()
    assert (startup.rule, startup.step, startup.model_only) == ("resume", 6, True)
    assert torch.equal(again.model_parts[0].output.weight, state.model_parts[0].output.weight)

    longer = make_cfg(run_dir, steps=8)
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        startup = manager_for(longer, tiny_state(longer)).restore_at_startup()
    assert (startup.step, startup.model_only) == (4, False)
    assert "skipping model-only step-6" in caplog.text


def test_by_default_a_finished_run_continues_from_its_last_step_when_extended(run_dir):
    """The final save holds the whole state unless last_save_model_only asks for an export, so rerunning with
    more steps continues from the last step, even when it is the run's only checkpoint."""
    default = JobConfig().checkpoint.last_save_model_only
    assert default is False
    cfg = make_cfg(run_dir, steps=3, interval=10, last_save_model_only=default)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 3, cfg)
    manager.close()
    assert read_record(run_dir / "checkpoint" / "step-3").kind == "full"
    longer = make_cfg(run_dir, steps=9, last_save_model_only=default)
    resumed = tiny_state(longer)
    startup = manager_for(longer, resumed).restore_at_startup()
    assert (startup.rule, startup.step, startup.model_only) == ("resume", 3, False)
    assert resumed.step == 3 and torch.equal(resumed.model_parts[0].output.weight, state.model_parts[0].output.weight)


def test_only_model_only_checkpoints_mid_run_cannot_resume(run_dir):
    cfg = make_cfg(run_dir, steps=3, interval=10)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 3, cfg)
    manager.close()
    longer = make_cfg(run_dir, steps=9)
    with pytest.raises(DtrainError, match=r"only model-only checkpoints .*\(step-3\).*initial_load_path"):
        manager_for(longer, tiny_state(longer)).restore_at_startup()


def test_retention_keeps_the_newest_k(run_dir):
    cfg = make_cfg(run_dir, steps=8, interval=1, keep_latest_k=3, last_save_model_only=False)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 8, cfg)
    manager.close()
    assert [c.step for c in scan_checkpoints(run_dir / "checkpoint").committed] == [6, 7, 8]
    assert read_record(run_dir / "checkpoint" / "step-8").kind == "full"


def test_seed_checkpoint_gives_the_same_run_as_the_initialisation_it_saved(run_dir):
    seed_cfg = make_cfg(run_dir)
    seed_cfg.debug.seed = 7  # the weights come from seed 7 ...
    path = manager_for(seed_cfg, tiny_state(seed_cfg)).save_seed_checkpoint()
    assert path.name == "step-0" and read_record(path).model_only
    with pytest.raises(DtrainError, match="already holds checkpoints"):
        manager_for(seed_cfg, tiny_state(seed_cfg)).save_seed_checkpoint()

    cfg = make_cfg(run_dir)  # ... and a run with seed 0 in the same folder starts from them
    state = tiny_state(cfg)
    startup = manager_for(cfg, state).restore_at_startup()
    assert (startup.rule, startup.step, startup.model_only) == ("resume", 0, True)
    assert not state.optimizer.state  # nothing touched the optimizer: it is as fresh as at a scratch start

    seed_everything(7, "init")
    expected = train(tiny_state(cfg, model=Transformer(TINY_ARGS)), None, 3, cfg)
    assert train(state, None, 3, cfg) == expected
