"""A family's optional step hooks (FamilySpec.extra_loss, FamilySpec.after_optimizer_step) reach the step through
the executor the trainer builds for it; the extra term is reported apart from the loss; pipeline parallelism
refuses it before launch only where torch cannot split its backward."""

from dataclasses import replace

import pytest
import torch
from test_step import ARGS, NoData, split

from dtrain.config.schema import JobConfig, LRScheduler, Optimizer
from dtrain.errors import ConfigError
from dtrain.models.llama3 import Transformer
from dtrain.parallelize import FamilySpec, ParallelDims, ParallelizeOptions, get_family
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.run.build_state import build_step_executor
from dtrain.run.layout import ParallelLayout, check_layout
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.train_step import StepLoss, train_step

LLAMA3 = get_family("llama3")
ONE_PROCESS = ParallelLayout(ParallelDims(1), ParallelizeOptions())
# The extra term's gradient on the final norm's weight: one COEFF per step, however many microbatches.
COEFF = 0.25


def state_for(family: FamilySpec) -> TrainState:
    """The state the trainer builds for `family` on one process (same weights for every family)."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    optimizer = build_optimizers([model], Optimizer(lr=1e-2), torch.device("cpu"))
    scheduler = build_lr_scheduler(optimizer, 100, LRScheduler(warmup_steps=2))
    loss = StepLoss.build(ONE_PROCESS.dims)
    executor = build_step_executor(family, ONE_PROCESS, [StageModule(0, model)], loss, torch.device("cpu"))
    return TrainState([model], optimizer, scheduler, NoData(), StepSetup(executor, seed=0, max_norm=0.0))


def step_gradients(family: FamilySpec, microbatches: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One train_step's gradients, as a hook right after the optimizer step sees them, and its metrics."""
    seen = {}

    def keep_gradients(model_parts):
        seen.update({name: p.grad.clone() for name, p in model_parts[0].named_parameters()})

    state = state_for(replace(family, after_optimizer_step=keep_gradients))
    return seen, train_step(state, split(0, microbatches))


@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("terms", [1, 2])
def test_extra_loss_is_added_to_the_objective_once_per_step(microbatches, terms):
    calls = []

    def norm_weight_term(model_parts):
        calls.append(model_parts)
        return terms * COEFF * model_parts[0].norm.weight.sum()

    family = replace(LLAMA3, extra_loss=norm_weight_term, extra_loss_terms=lambda model_parts: terms)
    plain, plain_metrics = step_gradients(LLAMA3, microbatches)
    extra, extra_metrics = step_gradients(family, microbatches)
    assert len(calls) == microbatches  # once per microbatch, after its forward
    # The mean of the terms (the sum over their number) counts once per step.
    torch.testing.assert_close(extra.pop("norm.weight"), plain.pop("norm.weight") + COEFF)
    for name, grad in plain.items():
        torch.testing.assert_close(extra[name], grad, rtol=0, atol=0)
    assert extra_metrics["loss"] == plain_metrics["loss"]  # the reported loss is the cross-entropy alone
    # ... and the term apart, as it entered the objective (the norm weights are ones at init).
    torch.testing.assert_close(extra_metrics["aux_loss"], torch.tensor(COEFF * ARGS.dim))
    assert "aux_loss" not in plain_metrics


def test_extra_loss_of_none_adds_nothing():
    plain, _ = step_gradients(LLAMA3, 2)
    nothing, _ = step_gradients(replace(LLAMA3, extra_loss=lambda model_parts: None), 2)
    for name, grad in plain.items():
        torch.testing.assert_close(nothing[name], grad, rtol=0, atol=0)


def test_after_optimizer_step_runs_once_per_step_after_the_update():
    calls = []

    def record(model_parts):
        weight = model_parts[0].output.weight
        calls.append((model_parts, weight.detach().clone(), weight.grad is not None))

    state = state_for(replace(LLAMA3, after_optimizer_step=record))
    before = state.model_parts[0].output.weight.detach().clone()
    for step in range(3):
        train_step(state, split(step, 2))
    assert len(calls) == 3
    model_parts, after_first_update, had_gradients = calls[0]
    assert model_parts is state.model_parts
    assert not torch.equal(after_first_update, before)  # the optimizer has already stepped
    assert had_gradients  # the gradients are not cleared yet


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_extra_loss_under_pipeline_parallelism_is_refused_only_where_torch_cannot_split_its_backward(
    schedule, monkeypatch
):
    cfg = JobConfig()
    cfg.parallelism.pipeline_parallel_degree = 2
    cfg.parallelism.pipeline_parallel_schedule = schedule
    family = replace(LLAMA3, extra_loss=lambda model_parts: None)
    monkeypatch.setattr("dtrain.parallelize.family_spec.SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS", True)
    check_layout(cfg, 2, family, ARGS)  # torch >= 2.13 runs every schedule with it
    monkeypatch.setattr("dtrain.parallelize.family_spec.SPLIT_BACKWARD_RUNS_CUSTOM_FUNCTIONS", False)
    check_layout(cfg, 2, LLAMA3, ARGS)  # without an extra term every schedule runs
    if schedule == "1F1B":
        check_layout(cfg, 2, family, ARGS)
    else:
        with pytest.raises(ConfigError, match="adds an extra loss term, which torch .* cannot run under "
                                              "parallelism.pipeline_parallel_schedule=ZBVZeroBubble"):
            check_layout(cfg, 2, family, ARGS)
