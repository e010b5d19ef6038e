"""A resume never silently changes or ignores the optimizer's parameter groups: the commit record names the
grouping (optimizer.no_decay_on_vectors), and a changed grouping or weight_decay / beta / eps is refused in one line,
because loading the state would put the checkpoint's back (torch's rule, which torchtitan 0.2.2 keeps silently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from checkpoint_helpers import make_cfg, manager_for, tiny_state, train

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.folders import COMMIT_FILE, read_record
from dtrain.errors import DtrainError

FRESH = 'checkpoint.exclude_from_loading = ["optimizer"] to start the optimizer afresh'


def save_step_2(run_dir: Path, **optimizer) -> tuple:
    """(config, its step-2 checkpoint) of a run with these optimizer settings."""
    cfg = make_cfg(run_dir)
    for key, value in optimizer.items():
        setattr(cfg.optimizer, key, value)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 2, cfg)
    manager.close()
    return cfg, run_dir / "checkpoint" / "step-2"


def resume(cfg):
    state = tiny_state(cfg)
    return manager_for(cfg, state).restore_at_startup(), state


def forget_grouping(path: Path) -> None:
    """Rewrite the commit record as one from before it named the grouping (the record is not checksummed)."""
    raw = json.loads((path / COMMIT_FILE).read_text())
    del raw["optimizer_grouping"]
    (path / COMMIT_FILE).write_text(json.dumps(raw))


def test_what_a_load_does_unchecked_keep_the_checkpoint_hyperparameters(run_dir):
    """Why the checks exist: torch's optimizer load puts the checkpoint's weight_decay, betas and eps back over this
    run's, and two saved groups load into one with the first (decayed) group's weight decay."""
    cfg, path = save_step_2(run_dir, no_decay_on_vectors=True)
    cfg.optimizer.no_decay_on_vectors, cfg.optimizer.weight_decay = False, 0.05
    cfg.optimizer.beta2, cfg.optimizer.eps = 0.99, 1e-6
    state = tiny_state(cfg)
    current = state.state_dict()
    dcp_io.load(current, path)
    state.load_state_dict(current)
    [group] = state.optimizer.param_groups
    assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.1, (0.9, 0.95), 1e-8)


@pytest.mark.parametrize("saved, ours", [(False, True), (True, False)])
def test_the_record_names_the_grouping_and_a_change_is_refused(run_dir, saved, ours):
    cfg, path = save_step_2(run_dir, no_decay_on_vectors=saved)
    assert read_record(path).optimizer_grouping == ("no_decay_on_vectors" if saved else "all")
    cfg.optimizer.no_decay_on_vectors = ours
    with pytest.raises(DtrainError) as refused:
        resume(cfg)
    layout = "two parameter groups, 1-D parameters not decayed" if saved else (
        "one parameter group, every parameter decayed")
    flag, other = str(saved).lower(), str(ours).lower()
    assert str(refused.value) == (
        f"checkpoint {path} was saved with optimizer.no_decay_on_vectors = {flag} ({layout}), this run has {other}, "
        f"which a resume cannot apply to its optimizer state: set optimizer.no_decay_on_vectors = {flag}, or {FRESH}"
    )
    cfg.checkpoint.exclude_from_loading = ["optimizer"]
    startup, fresh = resume(cfg)
    assert startup.step == 2 and not fresh.optimizer.state
    assert len(fresh.optimizer.param_groups) == (2 if ours else 1)


def test_an_old_two_group_checkpoint_is_refused_into_one_group(run_dir):
    """A record without the grouping: the stored per-parameter weight decay shows the two groups."""
    cfg, path = save_step_2(run_dir, no_decay_on_vectors=True)
    forget_grouping(path)
    assert read_record(path).optimizer_grouping == ""
    cfg.optimizer.no_decay_on_vectors = False
    with pytest.raises(DtrainError, match=r"saved with optimizer.no_decay_on_vectors = true \(two parameter groups"):
        resume(cfg)
    cfg.optimizer.no_decay_on_vectors = True
    startup, state = resume(cfg)
    assert startup.step == 2 and [g["weight_decay"] for g in state.optimizer.param_groups] == [0.1, 0.0]


def test_an_old_one_group_checkpoint_is_refused_into_two(run_dir):
    cfg, path = save_step_2(run_dir)
    forget_grouping(path)
    cfg.optimizer.no_decay_on_vectors = True
    with pytest.raises(DtrainError, match=r"saved with optimizer.no_decay_on_vectors = false \(one parameter group"):
        resume(cfg)


def test_without_weight_decay_an_old_checkpoint_resumes_in_either_grouping(run_dir):
    """No parameter decays in either grouping: the stored state cannot tell them apart, nor would the numbers."""
    cfg, path = save_step_2(run_dir, no_decay_on_vectors=True, weight_decay=0.0)
    forget_grouping(path)
    cfg.optimizer.no_decay_on_vectors = False
    startup, state = resume(cfg)
    assert startup.step == 2 and state.optimizer.state
    assert [g["weight_decay"] for g in state.optimizer.param_groups] == [0.0]


@pytest.mark.parametrize(
    "key, value, saved",
    [("weight_decay", 0.05, "0.1"), ("beta1", 0.8, "0.9"), ("beta2", 0.99, "0.95"), ("eps", 1e-6, "1e-08")],
)
@pytest.mark.parametrize("no_decay_on_vectors", [False, True])
def test_a_changed_hyperparameter_is_refused_not_silently_overridden(run_dir, key, value, saved, no_decay_on_vectors):
    cfg, path = save_step_2(run_dir, no_decay_on_vectors=no_decay_on_vectors)
    setattr(cfg.optimizer, key, value)
    with pytest.raises(DtrainError) as refused:
        resume(cfg)
    message = str(refused.value)
    assert message.startswith(f"checkpoint {path} holds optimizer state with optimizer.{key} = {saved} (for ")
    assert message.endswith(
        f"this run has {value:g}, which a resume cannot apply (the checkpoint's would silently stay, as in "
        f"torchtitan): set optimizer.{key} = {saved}, or {FRESH} with this run's"
    )
    cfg.checkpoint.exclude_from_loading = ["optimizer"]
    startup, fresh = resume(cfg)
    group = fresh.optimizer.param_groups[0]
    applied = {"weight_decay": group["weight_decay"], "beta1": group["betas"][0], "beta2": group["betas"][1],
               "eps": group["eps"]}
    assert startup.step == 2 and applied[key] == value


def test_a_changed_learning_rate_resumes_on_the_new_schedule(run_dir):
    """lr is the schedule's, set at every step, so a new optimizer.lr applies (its rate at step 2 of warmup 2)."""
    cfg, _ = save_step_2(run_dir)
    cfg.optimizer.lr = 5e-3
    startup, state = resume(cfg)
    assert startup.step == 2 and state.optimizer.state
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * state.lr_scheduler.lr_lambdas[0](2))


def test_adamw_state_continues_in_adam_as_adam_and_on_this_runs_kernel(run_dir, caplog):
    """torch's Adam and AdamW are one class told apart by a group setting, which a load would put back (AdamW's
    decay in a run configured as Adam), as it would the kernel flags of optimizer.implementation."""
    cfg, _ = save_step_2(run_dir)  # AdamW, foreach on CPU
    cfg.optimizer.name, cfg.optimizer.implementation = "Adam", "for-loop"
    with caplog.at_level("INFO", logger="dtrain"):
        startup, state = resume(cfg)
    [group] = state.optimizer.param_groups
    assert startup.step == 2 and state.optimizer.state
    assert (group["decoupled_weight_decay"], group["foreach"], group["fused"]) == (False, False, False)
    assert "the optimizer's decoupled_weight_decay, foreach are this run's, not the checkpoint's" in caplog.text
