"""Preference tuning on 2-rank layouts, in one gloo world: FSDP2, DDP, FSDP2 with 2 accumulated microbatches per
step (pairs never split: each rank and microbatch holds whole pairs), and a LoRA run under FSDP2 whose reference is
its base with the adapters disabled. Each reproduces the single-process run (the real train_step with the
preference loss and its reference, a frozen copy sharded like the policy), fp32, 1e-5: the loss and the TRL
metrics of every step (relative to values above 1, absolute below).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch

from dtrain.config.preference import Preference
from dtrain.config.schema import LoRA, LRScheduler, Optimizer
from dtrain.parallelize import ParallelDims, ParallelizeOptions, get_family, init_weights_like_single_device
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.precision.lora import LoRATraining, init_lora_weights
from dtrain.preference.loss import PreferenceLoss
from dtrain.preference.reference import AdaptersOff, FrozenCopy
from dtrain.run.build_state import build_step_executor
from dtrain.run.layout import ParallelLayout, rank_coordinates
from dtrain.run.world import dp_rank_and_size
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.train_step import train_step

from dist_harness import run_world
from parity_layouts import ARGS, SEED, NoData, family_spec, mesh_for, plain

pytestmark = [pytest.mark.multiprocess]

STEPS, PAIRS, SEQ_LEN = 4, 8, 16
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "grad_norm")
LORA = LoRA(enable=True, rank=4, alpha=8.0, target_modules=["all-linear"])


@dataclass(frozen=True)
class PairLayout:
    name: str
    degrees: dict = field(default_factory=dict)  # none: one process
    microbatches: int = 1
    lora: bool = False  # LoRA on every linear, the reference its base with the adapters disabled

    @property
    def reference(self) -> bool:
        return self.lora


LAYOUTS = [
    PairLayout("fsdp", dict(dp_shard=2)),
    PairLayout("ddp", dict(dp_replicate=2, dp_shard=1)),
    PairLayout("fsdp_accumulation", dict(dp_shard=2), microbatches=2),
    PairLayout("fsdp_lora_adapters_off", dict(dp_shard=2), lora=True),
]


def global_pairs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PAIRS pairs of random sequences: [2, PAIRS, SEQ_LEN] inputs and labels, the answer a random-length tail."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, ARGS.vocab_size, (2, PAIRS, SEQ_LEN + 1), generator=generator)
    tokens[1, :, :4] = tokens[0, :, :4]  # a shared prompt
    starts = torch.randint(4, SEQ_LEN - 2, (2, PAIRS, 1), generator=generator)
    labels = torch.where(torch.arange(SEQ_LEN) >= starts, tokens[..., 1:], IGNORE_INDEX)
    return tokens[..., :-1], labels


def microbatches(step: int, dp_rank: int, dp_size: int, count: int) -> list[dict[str, torch.Tensor]]:
    """This rank's microbatches as the loader makes them: whole pairs, chosen rows then rejected rows."""
    inputs, labels = global_pairs(step)
    size = PAIRS // (dp_size * count)
    batches = []
    for m in range(count):
        block = slice((m * dp_size + dp_rank) * size, (m * dp_size + dp_rank + 1) * size)
        batches.append({"input_ids": inputs[:, block].flatten(0, 1), "labels": labels[:, block].flatten(0, 1)})
    return batches


def build_parts(dims: ParallelDims, mesh, lora: bool) -> list[torch.nn.Module]:
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(ARGS)
    if lora:
        LoRATraining(LORA).convert(model)
    twin = copy.deepcopy(model)  # the unparallelized model, for the single-device init
    if mesh is not None:
        model = get_family("llama3").parallelize(model, mesh, dims, ParallelizeOptions())
    model.to_empty(device="cpu")
    init_weights_like_single_device(model, twin, SEED)
    if lora:
        init_lora_weights(model, SEED)
        # Adapters that start at zero leave the policy equal to its reference: move them off it.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_b" in name:
                    p.fill_(0.01)
    return [model]


def run(layout: PairLayout, mesh, dims: ParallelDims) -> dict:
    parts = build_parts(dims, mesh, layout.lora)
    reference = AdaptersOff(parts) if layout.lora else FrozenCopy(build_parts(dims, mesh, False), parts)
    loss = PreferenceLoss(Preference(beta=0.5), reference)
    rank = rank_coordinates(mesh, ParallelizeOptions().cp_load_balancer)
    parallel = ParallelLayout(dims, ParallelizeOptions(), mesh, None, rank)
    optimizer = build_optimizers(parts, Optimizer(lr=1e-2), torch.device("cpu"))
    scheduler = build_lr_scheduler(optimizer, STEPS, LRScheduler(warmup_steps=2))
    executor = build_step_executor(family_spec("llama3"), parallel, [StageModule(0, parts[0])], loss,
                                   torch.device("cpu"))
    state = TrainState(parts, optimizer, scheduler, NoData(), StepSetup(executor, seed=SEED, max_norm=1.0, rank=rank))
    dp_rank, dp_size = dp_rank_and_size(mesh)
    steps = [train_step(state, microbatches(step, dp_rank, dp_size, layout.microbatches)) for step in range(STEPS)]
    return {key: [float(plain(metrics[key])) for metrics in steps] for key in METRICS}


def run_pair_layouts(rank: int, world_size: int, layouts: list[PairLayout]) -> dict:
    report: dict = {"reference": {}}
    if rank == 0:  # the single-process runs, with the reference of each kind
        for lora in sorted({layout.lora for layout in layouts}):
            report["reference"][lora] = run(PairLayout("single", lora=lora), None, ParallelDims(1))
    meshes: dict = {}
    for layout in layouts:
        dims = ParallelDims(world_size, **layout.degrees)
        report[layout.name] = run(layout, mesh_for(dims, meshes), dims)
    return report


@pytest.fixture(scope="module")
def report():
    return run_world(2, run_pair_layouts, LAYOUTS, timeout_s=240)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_preference_layout_matches_single_process(report, layout):
    single, ours = report["reference"][layout.reference], report[layout.name]
    for key in METRICS:
        # Relative to values above 1, absolute below: a reward is a small difference of two large log-probabilities.
        assert ours[key] == pytest.approx(single[key], rel=1e-5, abs=1e-5), key
    assert len(set(single["loss"])) == STEPS  # it trains
