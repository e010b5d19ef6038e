"""LoRA on every layout of 2 ranks, in one world: FSDP2, DDP, TP, TP+SP, CP, FSDP2 with activation checkpointing
and with compile, 2-rank pipelines (1F1B, and zero-bubble with its split backward), and QLoRA (NF4 base weights)
under FSDP2, plain, compiled and with activation checkpointing; then FSDP2 x TP+SP, HSDP and a pipeline over FSDP2
in a world of 4. Each reproduces the single-process LoRA run (QLoRA's: the single-process QLoRA run) at fp32, 1e-5,
from the same initial weights exactly, with optimizer state for the adapters only.

Every linear of the blocks and the output head carries adapters (``all-linear`` plus ``output``), so the TP
layouts cover column-parallel (wq/wk/wv/w1/w3, the vocab-sharded head under loss parallel) and row-parallel (wo,
w2) bases, with and without sequence parallel. Dropout is 0 here: the adapters' dropout draws from torch's
generator as every other dropout would, which one process and a sharded layout consume differently.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import pytest
import torch

from dtrain.config.schema import LoRA
from dtrain.observe.compile_report import collect_compile_report
from dtrain.parallelize import ParallelDims, ParallelizeOptions, get_family, init_weights_like_single_device, model_fqn
from dtrain.parallelize.pipeline_plan import plan_pipeline
from dtrain.parallelize.pipeline_split import StageModule, split_model
from dtrain.precision.lora import LoRATraining, init_lora_weights, lora_state_dict
from dtrain.precision.qlora import is_nf4, quantize_base_weights

from dist_harness import run_world
from parity_layouts import (
    ARGS, GLOBAL_BATCH, SEED, STEPS, max_relative_diff, mesh_for, new_state, plain, run_steps, whole_model,
)

pytestmark = [pytest.mark.multiprocess]

ALL_LINEAR = ("all-linear", "output")
PIPELINE_ARGS = replace(ARGS, n_layers=4)  # two stages of two blocks
# QLoRA: every linear a whole number of NF4 scale blocks (64 x 256 values), split evenly between 2 FSDP shards.
QLORA_ARGS = replace(ARGS, dim=256, multiple_of=256)
FSDP, DDP, TP, CP = dict(dp_shard=2), dict(dp_replicate=2, dp_shard=1), dict(tp=2, dp_shard=1), dict(cp=2, dp_shard=1)


@dataclass(frozen=True)
class LoRALayout:
    name: str
    degrees: dict
    options: dict = field(default_factory=dict)
    microbatches: int = 1
    pipeline_schedule: str | None = None  # pp = 2 with this schedule
    targets: tuple[str, ...] = ALL_LINEAR  # [lora] target_modules
    quantize_base: bool = False  # QLoRA: NF4 base weights, quantized after the init

    @property
    def args(self):
        return QLORA_ARGS if self.quantize_base else PIPELINE_ARGS if self.pipeline_schedule else ARGS

    @property
    def reference(self) -> tuple:
        """The single-process run this layout is compared with: same depth, same targets, same base storage."""
        return self.args.n_layers, self.targets, self.quantize_base

    @property
    def settings(self) -> LoRA:
        return LoRA(enable=True, rank=4, alpha=8.0, target_modules=list(self.targets), quantize_base=self.quantize_base)


LAYOUTS = [
    LoRALayout("fsdp", FSDP, microbatches=2),
    LoRALayout("ddp", DDP),
    LoRALayout("tp", {**TP, "sequence_parallel": False}),
    LoRALayout("tp_sp", TP),
    # Adapters on some blocks only: the plan's block-wide paths are spelled out per block for them.
    LoRALayout("tp_sp_some_blocks", TP, targets=("layers.0.attention.wq", "layers.1.feed_forward.w2", "wo")),
    LoRALayout("cp", CP),
    LoRALayout("fsdp_ac_full", FSDP, dict(ac_mode="full")),
    LoRALayout("fsdp_compile", FSDP, dict(compile_model=True, compile_backend="aot_eager")),
    LoRALayout("pp_1f1b", dict(pp=2, dp_shard=1), pipeline_schedule="1F1B"),
    # Two stages per rank, the weight gradients in a pass of their own (of the adapters only).
    LoRALayout("pp_zbv_zero_bubble", dict(pp=2, dp_shard=1), pipeline_schedule="ZBVZeroBubble"),
    # QLoRA under FSDP2: NF4 codes and scales sharded by rows and all-gathered (torchao's FSDP2 hooks).
    LoRALayout("qlora_fsdp", FSDP, microbatches=2, quantize_base=True),
    LoRALayout("qlora_fsdp_compile", FSDP, dict(compile_model=True, compile_backend="aot_eager"), quantize_base=True),
    LoRALayout("qlora_fsdp_ac_full", FSDP, dict(ac_mode="full"), quantize_base=True),
]
# What needs 4 ranks: FSDP2 over TP+SP DTensors (the adapters' Replicate and Shard placements gain a dp dimension),
# and HSDP.
LAYOUTS_4_RANKS = [
    LoRALayout("fsdp_tp_sp", dict(dp_shard=2, tp=2)),
    LoRALayout("hsdp", dict(dp_replicate=2, dp_shard=2)),
    LoRALayout("pp_fsdp", dict(pp=2, dp_shard=2), pipeline_schedule="1F1B"),
]


def lora_meta_model(args, settings: LoRA) -> torch.nn.Module:
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(args)
    LoRATraining(settings).convert(model)
    return model


def single_process_run(layout: LoRALayout) -> dict:
    """One process: meta, LoRA, to_empty, seeded init, adapters' init; 2 microbatches per step."""
    model = lora_meta_model(layout.args, layout.settings)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    init_lora_weights(model, SEED)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    if layout.quantize_base:
        quantize_base_weights([model])
    run = run_steps(new_state(whole_model(model)), range(STEPS), None, accumulation=2)
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    return {**run, "initial": initial, "trainable": trainable}


def lora_stages(layout: LoRALayout, dims: ParallelDims, mesh) -> tuple[list[StageModule], object]:
    """This rank's stages as the trainer builds them: LoRA on the meta model, split, parallelize, materialize,
    the single-device init, then the adapters' init."""
    spec = get_family("llama3")
    model = lora_meta_model(layout.args, layout.settings)
    plan = None
    if layout.pipeline_schedule:
        plan = plan_pipeline(
            pp=dims.pp, schedule=layout.pipeline_schedule, decoder=spec.model.model_cls.decoder_layout,
            n_layers=layout.args.n_layers, local_batch_size=GLOBAL_BATCH // dims.dp_size, microbatch_size=2,
            layers_per_stage=None, ddp=dims.ddp_enabled,
        )
    reference = copy.deepcopy(model)
    stages = split_model(model, plan, mesh["pp"].get_local_rank()) if plan else [StageModule(0, model)]
    options = ParallelizeOptions(**layout.options)
    for stage in stages:
        spec.parallelize(stage.module, mesh, dims, options)
        stage.module.to_empty(device="cpu")
        init_weights_like_single_device(stage.module, reference, SEED)
        init_lora_weights(stage.module, SEED)
    return stages, plan


def run_lora_layouts(rank: int, world_size: int, layouts: list[LoRALayout]) -> dict:
    references = {}
    if rank == 0:
        wanted = {layout.reference: layout for layout in layouts}
        references = {key: single_process_run(layout) for key, layout in wanted.items()}
    report: dict = {"reference": references}
    meshes: dict = {}
    for layout in layouts:
        compiled = layout.options.get("compile_model", False)
        if compiled:  # the compile report counts over the process: start from zero
            torch._dynamo.reset()
            torch._dynamo.utils.clear_compilation_metrics()
            torch._dynamo.utils.counters.clear()
        dims = ParallelDims(world_size, **layout.degrees)
        mesh = mesh_for(dims, meshes)
        stages, plan = lora_stages(layout, dims, mesh)
        parts = [stage.module for stage in stages]
        local = {model_fqn(n): plain(p.detach()).clone() for part in parts for n, p in part.named_parameters()}
        placements = {
            model_fqn(n): str(p.placements) for part in parts for n, p in part.named_parameters()
            if hasattr(p, "placements") and model_fqn(n).startswith("layers.0.")
        }
        trainable = [model_fqn(n) for part in parts for n, p in part.named_parameters() if p.requires_grad]
        adapters = {name: t for part in parts for name, t in lora_state_dict(part).items()}  # a collective
        if layout.quantize_base:  # after the init, as the run's start-up quantizes after its load
            quantize_base_weights(parts)
        nf4 = sorted(model_fqn(n) for part in parts for n, p in part.named_parameters() if is_nf4(p))
        options = ParallelizeOptions(**layout.options)
        state = new_state(stages, dims, mesh, plan, options=options)
        result = run_steps(state, range(STEPS), mesh, layout.microbatches)
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, (local, trainable))
        initial = {name: t for rank_initial, _ in gathered for name, t in rank_initial.items()}
        moments = [name for part, opt in zip(parts, state.optimizer.optimizers) for name in _with_state(part, opt)]
        report[layout.name] = {
            **result, "initial": initial, "trainable": sorted({n for _, names in gathered for n in names}),
            "placements": placements, "optimizer_state_params": moments,
            "compile": collect_compile_report() if compiled else None, "adapters": adapters, "nf4": nf4,
        }
    return report


def _with_state(part: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    return [model_fqn(name) for name, p in part.named_parameters() if optimizer.state.get(p)]


@pytest.fixture(scope="module")
def report():
    return run_world(2, run_lora_layouts, LAYOUTS, timeout_s=300)


@pytest.fixture(scope="module")
def report_4_ranks():
    return run_world(4, run_lora_layouts, LAYOUTS_4_RANKS, timeout_s=300)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_lora_layout_matches_single_process(report, layout):
    assert_matches_single_process(report, layout)


@pytest.mark.parametrize("layout", LAYOUTS_4_RANKS, ids=lambda layout: layout.name)
def test_lora_layout_of_4_ranks_matches_single_process(report_4_ranks, layout):
    assert_matches_single_process(report_4_ranks, layout)
    assert report_4_ranks[layout.name]["optimizer_state_params"]


def assert_matches_single_process(report: dict, layout: LoRALayout) -> None:
    result = report[layout.name]
    reference = report["reference"][layout.reference]
    assert sorted(result["initial"]) == sorted(reference["initial"])
    assert max((result["initial"][k] - v).abs().max().item() for k, v in reference["initial"].items()) == 0.0
    assert result["trainable"] == reference["trainable"]
    assert max_relative_diff(result["losses"], reference["losses"]) <= 1e-5
    assert max_relative_diff(result["grad_norms"], reference["grad_norms"]) <= 1e-4
    assert result["losses"][-1] < result["losses"][0]
    # lora_state_dict: this rank's adapters, whole (a pipeline rank holds its stages' only).
    adapters = result["adapters"]
    assert adapters and all(torch.equal(tensor, reference["initial"][name]) for name, tensor in adapters.items())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_only_adapters_have_optimizer_state(report, layout):
    names = report[layout.name]["optimizer_state_params"]
    assert names and all(".lora_a." in name or ".lora_b." in name for name in names)


@pytest.mark.parametrize("name", ["fsdp_compile", "qlora_fsdp_compile"])
def test_blocks_with_adapters_compile_without_breaks(report, name):
    compiled = report[name]["compile"]
    assert compiled.graph_breaks == []
    # Twice, not once per block: the first block's input comes from the frozen embedding and needs no gradient,
    # the others' inputs do (they depend on adapters).
    assert compiled.frames_compiled == 2
    assert len(compiled.recompile_reasons) == 1 and "requires_grad mismatch" in compiled.recompile_reasons[0]


def test_adapters_follow_their_base_linear_under_tp(report):
    placements = report["tp_sp"]["placements"]
    prefix = "layers.0.attention"
    # Column-parallel wq: base and lora_b split by output features, lora_a whole.
    assert placements[f"{prefix}.wq.weight"] == "(Shard(dim=0),)"
    assert placements[f"{prefix}.wq.lora_a.weight"] == "(Replicate(),)"
    assert placements[f"{prefix}.wq.lora_b.weight"] == "(Shard(dim=0),)"
    # Row-parallel wo: base and lora_a split by input features, lora_b whole.
    assert placements[f"{prefix}.wo.weight"] == "(Shard(dim=1),)"
    assert placements[f"{prefix}.wo.lora_a.weight"] == "(Shard(dim=1),)"
    assert placements[f"{prefix}.wo.lora_b.weight"] == "(Replicate(),)"


def test_qlora_fsdp_shards_nf4_base_weights(report):
    """The QLoRA layout trained on NF4 shards: every adapted linear's base weight, nothing else."""
    for name in ("qlora_fsdp", "qlora_fsdp_compile", "qlora_fsdp_ac_full"):
        result = report[name]
        bases = {fqn.replace(".lora_a.weight", ".weight") for fqn in result["trainable"] if ".lora_a." in fqn}
        assert result["nf4"] == sorted(bases) and len(bases) == 7 * QLORA_ARGS.n_layers + 1

