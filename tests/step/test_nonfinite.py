"""A non-finite loss or gradient norm is caught: the guard names the first such step, and with
training.skip_nonfinite_steps the step leaves weights and optimizer state untouched up to the budget."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from test_step import make_state, split

from dtrain.step.executor import LocalExecutor
from dtrain.step.nonfinite import Diverged, NonFiniteGuard
from dtrain.step.train_step import StepLoss, cross_entropy_sum, train_step


def test_the_guard_names_the_first_non_finite_step_only_when_checked():
    guard = NonFiniteGuard(torch.device("cpu"))
    guard.record(1, torch.tensor(2.5), torch.tensor(1.0))
    guard.check()
    guard.record(2, torch.tensor(2.4), torch.tensor(float("inf")))
    guard.record(3, torch.tensor(float("nan")), torch.tensor(float("nan")))
    with pytest.raises(Diverged, match=r"^training diverged at step 2 \(loss 2.4, grad_norm inf\); stopped without"):
        guard.check()


def poisoned_state(skip: int, bad_steps: set[int]):
    """A state whose loss is scaled by inf on `bad_steps` (0-based calls of the loss), so its gradients are too."""
    calls = {"n": 0}

    def loss_fn(logits, labels):
        scale = float("inf") if calls["n"] in bad_steps else 1.0
        calls["n"] += 1
        return cross_entropy_sum(logits, labels) * scale

    state = make_state()
    state.setup = replace(state.setup, executor=LocalExecutor(StepLoss(loss_fn)), skip_nonfinite_steps=skip)
    return state


def test_skipped_steps_leave_weights_and_optimizer_state_untouched_until_the_budget_is_spent():
    state = poisoned_state(skip=1, bad_steps={1, 3})
    train_step(state, split(0, 1))
    optimizer = state.optimizer.optimizers[0]
    weights = copy.deepcopy(state.model_parts[0].state_dict())
    moments = [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()]
    metrics = train_step(state, split(1, 1))  # non-finite: skipped
    assert not torch.isfinite(metrics["grad_norm"]) and state.skipped_steps == 1 and state.step == 2
    after = state.model_parts[0].state_dict()
    assert all(torch.equal(after[k], weights[k]) for k in weights)
    assert all(torch.equal(now[k], then[k]) for now, then in zip(optimizer.state.values(), moments) for k in then)
    assert torch.isfinite(train_step(state, split(2, 1))["loss"])  # training goes on from the last good weights
    with pytest.raises(Diverged, match=r"training diverged at step 4 \(loss inf"):
        train_step(state, split(3, 1))


def test_without_the_policy_a_non_finite_step_updates_and_the_step_reads_nothing():
    state = poisoned_state(skip=0, bad_steps={0})
    metrics = train_step(state, split(0, 1))  # no host read, so no skip: the guard catches it at the next check
    assert not torch.isfinite(metrics["loss"]) and state.skipped_steps == 0
