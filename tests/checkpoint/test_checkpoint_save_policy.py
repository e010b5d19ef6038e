"""When the manager saves: checkpoint.enable_first_step_checkpoint adds a save after step 1, checkpoint.load_only
restores as usual and never saves (interval, last, preemption)."""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import make_cfg, manager_for, tiny_state, train

from dtrain.checkpoint import check_checkpoint_config
from dtrain.checkpoint.folders import read_record, scan_checkpoints
from dtrain.errors import ConfigError


def saved_steps(run_dir) -> list[int]:
    return [c.step for c in scan_checkpoints(run_dir / "checkpoint").committed]


def test_first_step_checkpoint_saves_the_full_state_after_step_1(run_dir):
    cfg = make_cfg(run_dir, steps=3, interval=10, enable_first_step_checkpoint=True)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    assert manager.save_due(1) and not manager.save_due(2)
    train(state, manager, 3, cfg)
    manager.close()
    assert saved_steps(run_dir) == [1, 3]
    assert read_record(run_dir / "checkpoint" / "step-1").kind == "full"


def test_without_it_step_1_is_not_saved(run_dir):
    cfg = make_cfg(run_dir, steps=3, interval=10)
    assert not manager_for(cfg, tiny_state(cfg)).save_due(1)


def test_load_only_resumes_and_never_saves(run_dir):
    first = make_cfg(run_dir, steps=4, last_save_model_only=False)
    state = tiny_state(first)
    manager = manager_for(first, state)
    train(state, manager, 4, first)
    manager.close()
    leftover = run_dir / "checkpoint" / "step-9.partial"
    leftover.mkdir()
    before = sorted(p.name for p in (run_dir / "checkpoint").iterdir())

    cfg = make_cfg(run_dir, steps=8, load_only=True, enable_first_step_checkpoint=True)
    resumed = tiny_state(cfg)
    manager = manager_for(cfg, resumed)
    startup = manager.restore_at_startup()
    assert (startup.rule, startup.step) == ("resume", 4)
    assert torch.equal(resumed.model_parts[0].output.weight, state.model_parts[0].output.weight)
    assert not any(manager.save_due(step, last=step == 8) for step in range(1, 9))
    train(resumed, manager, 8, cfg)
    assert not manager.maybe_save(8, last=True, preempted=True)
    manager.close()
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == before  # leftovers included


def test_load_only_from_an_initial_load_path_writes_no_checkpoint_folder(run_dir, tmp_path):
    source = make_cfg(tmp_path / "source", steps=2)
    state = tiny_state(source)
    manager = manager_for(source, state)
    train(state, manager, 2, source)
    manager.close()

    cfg = make_cfg(run_dir, steps=2, load_only=True, initial_load_path=str(tmp_path / "source" / "checkpoint"))
    fresh = tiny_state(cfg)
    manager = manager_for(cfg, fresh)
    assert manager.restore_at_startup().rule == "initial_load"
    train(fresh, manager, 2, cfg)
    manager.close()
    assert not (run_dir / "checkpoint").exists()


def test_load_only_refuses_to_create_a_seed_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.create_seed_checkpoint saves a checkpoint, "
                                          "checkpoint.load_only never does"):
        cfg = make_cfg(tmp_path, load_only=True, create_seed_checkpoint=True)
        check_checkpoint_config(cfg.checkpoint, cfg.optimizer.name, 1)
