"""A dataset mixture's loss and tokens by source (step/source_loss.py), on one process: what the step reports per
source adds up to the step's loss and token count, equals each source's loss computed directly from the model, and
leaves the training itself as it is without a mixture."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.parallelize import ParallelDims
from dtrain.step.executor import LocalExecutor
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.source_loss import SOURCE_IDS
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.train_step import StepLoss, train_step

ARGS = Llama3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
NAMES = ("web", "code", "books")
# The source of each of the 8 rows of a step's global batch; "books" (2) is missing from the step's batch at step 2.
ROW_SOURCES = torch.tensor([0, 1, 0, 2, 0, 1, 2, 0])


class NoData:
    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def make_state(loss: StepLoss) -> TrainState:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    opt = build_optimizers([model], Optimizer(lr=1e-2), torch.device("cpu"))
    sched = build_lr_scheduler(opt, 100, LRScheduler(warmup_steps=2))
    return TrainState([model], opt, sched, NoData(), StepSetup(LocalExecutor(loss), seed=0, max_norm=1.0))


def global_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, ARGS.vocab_size, (8, 17), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, :3] = IGNORE_INDEX  # uneven valid-token counts across rows and sources
    labels[3, 5:] = IGNORE_INDEX
    rows = torch.where(ROW_SOURCES == 2, 0, ROW_SOURCES) if step == 2 else ROW_SOURCES
    return {"input_ids": tokens[:, :-1], "labels": labels, SOURCE_IDS: rows[:, None].expand(8, 16).contiguous()}


def split(batch: dict[str, torch.Tensor], microbatches: int) -> list[dict[str, torch.Tensor]]:
    size = 8 // microbatches
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(microbatches)]


def mixture_loss() -> StepLoss:
    return StepLoss.build(ParallelDims(1), source_names=NAMES)


def test_per_source_metrics_add_up_to_the_step_and_equal_each_source_s_own_loss():
    state = make_state(mixture_loss())
    for step in range(4):
        batch = global_batch(step)
        model = state.model_parts[0]
        with torch.no_grad():  # each source's loss, straight from the model before the step updates it
            per_token = F.cross_entropy(
                model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                reduction="none",
            )
        metrics = train_step(state, split(batch, 2))  # gradient accumulation: 2 microbatches
        valid = batch["labels"].flatten() != IGNORE_INDEX
        sources = batch[SOURCE_IDS].flatten()
        tokens = {name: metrics[f"tokens/{name}"].item() for name in NAMES}
        assert sum(tokens.values()) == valid.sum().item()
        weighted = sum(metrics[f"loss/{name}"].item() * tokens[name] for name in NAMES if tokens[name])
        assert math.isclose(weighted / sum(tokens.values()), metrics["loss"].item(), rel_tol=1e-5)
        for index, name in enumerate(NAMES):
            mine = valid & (sources == index)
            assert tokens[name] == mine.sum().item()
            if tokens[name]:
                expected = per_token[mine].mean().item()
                assert math.isclose(metrics[f"loss/{name}"].item(), expected, rel_tol=1e-5), (step, name)
            else:  # a source the step's batch did not hold has no loss (the logger writes null)
                assert step == 2 and math.isnan(metrics[f"loss/{name}"].item())


def test_a_mixture_trains_as_the_same_data_without_one():
    plain, mixed = make_state(StepLoss()), make_state(mixture_loss())
    for step in range(3):
        batch = global_batch(step)
        without_sources = {k: v for k, v in batch.items() if k != SOURCE_IDS}
        expected = train_step(plain, split(without_sources, 2))
        got = train_step(mixed, split(batch, 2))
        assert math.isclose(got["loss"].item(), expected["loss"].item(), rel_tol=1e-6)
        assert math.isclose(got["grad_norm"].item(), expected["grad_norm"].item(), rel_tol=1e-5)
        assert not any(key.startswith(("loss/", "tokens/")) for key in expected)


def test_a_batch_without_source_ids_is_given_to_the_loss_as_labels_alone():
    loss = mixture_loss()
    batch = global_batch(0)
    assert loss.target(batch).shape == (8, 16, 2)
    assert loss.target({"labels": batch["labels"]}) is batch["labels"]  # validation: one dataset
    assert StepLoss().target(batch) is batch["labels"]  # no mixture configured: no per-source work


def test_the_compiled_loss_reports_the_same_per_source_metrics():
    """compile.components = ["loss"] compiles the per-token loss (aot_eager here: the same graphs, no codegen)."""
    compiled = StepLoss.build(ParallelDims(1), dict(backend="aot_eager"), source_names=NAMES)
    eager, traced = make_state(mixture_loss()), make_state(compiled)
    for step in range(2):
        batch = split(global_batch(step), 2)
        expected, got = train_step(eager, batch), train_step(traced, batch)
        for name in NAMES:
            assert torch.allclose(got[f"loss/{name}"], expected[f"loss/{name}"], rtol=1e-6)
            assert torch.equal(got[f"tokens/{name}"], expected[f"tokens/{name}"])
