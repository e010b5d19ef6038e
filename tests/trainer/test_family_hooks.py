"""A family's optional step hooks (FamilySpec.extra_loss, FamilySpec.after_optimizer_step) reach the step through
the executor the trainer builds for it; pipeline parallelism refuses an extra loss term before launch."""

from dataclasses import replace

import pytest
import torch

from dtrain.config.schema import JobConfig, LRScheduler, Optimizer
from dtrain.errors import ConfigError
from dtrain.layout import ParallelLayout, check_layout
from dtrain.lr_schedule import build_lr_scheduler
from dtrain.models.llama3 import Transformer
from dtrain.optim import build_optimizers
from dtrain.parallelize import FamilySpec, ParallelDims, ParallelizeOptions, get_family
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.state import TrainState
from dtrain.step import cross_entropy_sum, train_step
from dtrain.step_executor import build_step_executor
from test_step import ARGS, NoData, split

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
    executor = build_step_executor(family, ONE_PROCESS, [StageModule(0, model)], cross_entropy_sum, torch.device("cpu"))
    return TrainState([model], optimizer, scheduler, NoData(), executor, seed=0, max_norm=0.0)


def step_gradients(family: FamilySpec, microbatches: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One train_step's gradients, as a hook right after the optimizer step sees them, and its reported loss."""
    seen = {}

    def keep_gradients(model_parts):
        seen.update({name: p.grad.clone() for name, p in model_parts[0].named_parameters()})

    state = state_for(replace(family, after_optimizer_step=keep_gradients))
    metrics = train_step(state, split(0, microbatches))
    return seen, metrics["loss"]


@pytest.mark.parametrize("microbatches", [1, 4])
def test_extra_loss_is_added_to_the_objective_once_per_step(microbatches):
    calls = []

    def norm_weight_term(model_parts):
        calls.append(model_parts)
        return COEFF * model_parts[0].norm.weight.sum()

    plain, plain_loss = step_gradients(LLAMA3, microbatches)
    extra, extra_loss = step_gradients(replace(LLAMA3, extra_loss=norm_weight_term), microbatches)
    assert len(calls) == microbatches  # once per microbatch, after its forward
    torch.testing.assert_close(extra.pop("norm.weight"), plain.pop("norm.weight") + COEFF)
    for name, grad in plain.items():
        torch.testing.assert_close(extra[name], grad, rtol=0, atol=0)
    assert extra_loss == plain_loss  # the reported loss is the cross-entropy alone


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


def test_extra_loss_under_pipeline_parallelism_is_refused_before_launch():
    cfg = JobConfig()
    cfg.parallelism.pipeline_parallel_degree = 2
    check_layout(cfg, 2, LLAMA3, ARGS)  # the layout itself runs
    family = replace(LLAMA3, extra_loss=lambda model_parts: None)
    with pytest.raises(ConfigError, match="adds an extra loss term, which pipeline parallelism does not support"):
        check_layout(cfg, 2, family, ARGS)
