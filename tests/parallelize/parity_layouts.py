"""Train a tiny Llama 3 for a few steps in several layouts with the trainer's real step, and a single process too.

Every layout runs inside one spawned world (see dist_harness): build on meta, parallelize, materialize, initialise
like a single device, then STEPS optimizer steps of the real `train_step`, on a `TrainState` built like the
trainer's (one optimizer per model part, the trainer's step executor), on the same global batches. Rank 0
returns, per layout, the losses and gradient norms next to the single-process ones, how far the initial weights
are from the single-process init, and the per-rank memory footprint. A layout with
``options=dict(attention_mask="block_causal")`` trains with document masking (its batches carry document ids)
against a single process that does too. The pipeline tests (test_pipeline_*.py) share the state, the steps, the
baseline and the meshes from here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
from parity_converters import low_precision
from torch.distributed.tensor import DTensor

from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.data.dataloader import document_ids
from dtrain.models.deepseek_v3 import DeepSeekV3Args
from dtrain.models.llama3 import Llama3Args
from dtrain.models.qwen3 import Qwen3Args
from dtrain.observe.compile_report import collect_compile_report
from dtrain.parallelize import (
    ParallelDims,
    ParallelizeOptions,
    build_mesh,
    get_family,
    init_weights_like_single_device,
    memory_footprint,
    model_fqn,
    stop_compile_trace,
)
from dtrain.parallelize.mesh import ParallelMesh
from dtrain.parallelize.mixed_precision import autocast_forward
from dtrain.parallelize.pipeline_plan import PipelinePlan
from dtrain.parallelize.pipeline_split import StageModule
from dtrain.precision.float8 import Float8Training
from dtrain.precision.mx import MXTraining
from dtrain.run.build_state import build_step_executor
from dtrain.run.layout import ParallelLayout, rank_coordinates
from dtrain.run.world import dp_rank_and_size
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.train_step import StepLoss, train_step

ARGS = Llama3Args(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, ffn_dim_multiplier=None, max_seq_len=16
)
QWEN3_TINY = Qwen3Args(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=96, vocab_size=256, max_seq_len=16
)
# Every family's tiny model, on the same data (Qwen3's head_dim is not dim / n_heads, as in the real ones).
FAMILY_ARGS = {
    "llama3": ARGS,
    "qwen3": QWEN3_TINY,
    # Qwen3-MoE: 8 experts, 2 per token, with its auxiliary load-balancing loss, or with loss-free balancing
    # instead. The auxiliary loss takes its statistics over a data-parallel microbatch (all dp and cp ranks'
    # tokens of one forward), so its layouts run one process's 2 microbatches per step (Layout.microbatches=2).
    "qwen3_moe": replace(QWEN3_TINY, moe_num_experts=8, moe_top_k=2, moe_hidden_dim=32, moe_aux_loss_coeff=0.01),
    "qwen3_moe_bias": replace(
        QWEN3_TINY, moe_num_experts=8, moe_top_k=2, moe_hidden_dim=32, moe_aux_loss_coeff=0.0,
        moe_load_balance_bias=True,
    ),
    # DeepSeek-V3: latent attention (v head size apart from q/k's), one dense block then an MoE block routing like
    # DeepSeek-V3's (sigmoid, 4 groups of which 2 per token, a shared expert, loss-free balancing).
    "deepseek_v3": DeepSeekV3Args(
        dim=64, n_layers=2, n_dense_layers=1, hidden_dim=96, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, vocab_size=256, max_seq_len=16,
        moe_num_experts=8, moe_top_k=3, moe_hidden_dim=32, moe_num_shared_experts=1, moe_score_func="sigmoid",
        moe_route_norm=True, moe_route_scale=2.5, moe_num_expert_groups=4, moe_num_limited_groups=2,
        moe_load_balance_bias=True,
    ),
}
# Tiny models of a family that are not its default tiny model, by the family they belong to.
MODEL_FAMILY = {"qwen3_moe": "qwen3", "qwen3_moe_bias": "qwen3"}


def family_spec(model: str):
    """The FamilySpec of a FAMILY_ARGS key (a family's name, or one of MODEL_FAMILY's models)."""
    return get_family(MODEL_FAMILY.get(model, model))


STEPS = 10
GLOBAL_BATCH = 8
SEQ_LEN = 16
SEED = 1234
# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 = 2e-3 per operation). Over 10 steps of this tiny model
# the layouts round differently from the one bf16 process (FSDP's policy computes norms in bf16, autocast in fp32;
# sums in another order): measured up to 6.5e-4 in the loss (2026-11-23), so 2e-3 leaves a 3x margin. That the
# layouts compute in bf16 at all is checked directly, by the dtype of their matmul outputs: the tiny model's bf16
# and fp32 losses are only ~2e-4 apart, too close to tell the two apart by the loss alone.
BF16_LOSS_RTOL = 2e-3
# float8 rounding is a step function: an fp32-level difference in a float8 matmul's input (FSDP sums gradients in
# another order than one process) can move one element to the neighbouring e4m3 value, 2^-3 = 12% away. The loss
# still agrees to 1e-5, but a gradient norm can move by more than fp32 noise: measured 3.7e-4 at step 10 on torch
# 2.11 (2.5e-7 on 2.13), so float8 layouts bound the gradient norms at 1e-3.
FLOAT8_GRAD_NORM_RTOL = 1e-3
# Where a layout's fp32 arithmetic itself differs from one process (TP sums a row-parallel matmul's halves, CP splits
# attention and every float8 cast's input by sequence, PP sums gradients over other microbatches), float8 rounding
# amplifies those ulps: an element moves to the neighbouring e4m3 value, and a tensorwise scale moves with its
# tensor's largest element. The runs then drift apart at float8's own noise level (the float8 run is 2e-3 from the
# fp32 one, test_float8.py). Measured over 10 steps (2026-11-23, torch 2.13 / 2.11): TP 2 losses 3.6e-3 / -,
# gradient norms 5.5e-2 / -; FSDP x TP 1.2e-3 / 2.1e-3 and 1.4e-2 / 1.9e-2; CP 2 (rowwise) 7.7e-6 / 7.4e-4 and
# 2.6e-4 / 5.1e-3. That each float8 cast is right under TP is checked at fp32 precision on one block
# (test_parity_float8_tp.py).
FLOAT8_DRIFT_LOSS_RTOL = 1e-2
FLOAT8_DRIFT_GRAD_NORM_RTOL = 0.1
# MXFP8 (emulated) under FSDP2 against one MX process: FSDP's gradient sums in another order move an MX-rounded
# element now and then, as for float8, but the losses then drift further than float8's: 2.4e-5 over 10 steps
# (torch 2.13, 2026-11-23; torchao's MX training does not run on 2.11).
MX_LOSS_RTOL = 1e-4


@dataclass(frozen=True)
class Layout:
    """One way to lay the model out: ParallelDims degrees, ParallelizeOptions, accumulation and model tweaks.

    `microbatches` per step and rank (gradient accumulation); each costs a round of collectives, the main cost
    of these tests, so only some layouts accumulate.
    """

    name: str
    degrees: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    microbatches: int = 1
    tie_word_embeddings: bool = False
    family: str = "llama3"
    float8: dict | None = None  # [quantize.linear.float8] keys: train with float8 linears (emulated on CPU)
    mx: dict | None = None  # [quantize.linear.mx] keys: train with MXFP8 linears (the emulated recipe on CPU)

    @property
    def attention_mask(self) -> str:
        return self.options.get("attention_mask", "causal")

    @property
    def param_dtype(self) -> str:
        return self.options.get("param_dtype", "float32")

    @property
    def reference(self) -> tuple:
        """The single-process run this layout is compared with: same family, same tying (and same attention mask,
        float8 recipe and compute dtype, each named only when it is not the default)."""
        masked = (self.attention_mask,) if self.attention_mask != "causal" else ()
        float8 = (("float8", self.float8.get("recipe_name", "tensorwise")),) if self.float8 is not None else ()
        mx = (("mx", self.mx["recipe_name"]),) if self.mx is not None else ()
        dtype = (self.param_dtype,) if self.param_dtype != "float32" else ()
        return (self.family, self.tie_word_embeddings, *masked, *float8, *mx, *dtype)

    @property
    def tolerances(self) -> tuple[float, float | None]:
        """(loss, gradient norm) relative tolerances against one process (None: assert_matches_single_process's
        default)."""
        split_arithmetic = any(self.degrees.get(dim, 1) > 1 for dim in ("tp", "cp"))
        if (self.float8 is not None or self.mx is not None) and split_arithmetic:
            return FLOAT8_DRIFT_LOSS_RTOL, FLOAT8_DRIFT_GRAD_NORM_RTOL
        return (MX_LOSS_RTOL if self.mx is not None else 1e-5), None

    @property
    def args(self):
        return replace(FAMILY_ARGS[self.family], tie_word_embeddings=self.tie_word_embeddings)


class NoData:
    """TrainState wants a Stateful dataloader; batches are fed directly here."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


# Tokens come from a few ids spread over the whole vocabulary (so every TP rank's vocabulary shard sees some):
# a model learns their frequencies within a few steps whatever its initialisation, so "the loss falls" is a
# real check, not the luck of one torch version's random init.
TOKEN_IDS = torch.arange(0, ARGS.vocab_size, ARGS.vocab_size // 16)
# Under document masking this one of them starts a document (as BOS does in packed data): about one per sequence.
BOS_ID = int(TOKEN_IDS[0])


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 + step)
    tokens = TOKEN_IDS[torch.randint(0, len(TOKEN_IDS), (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)]
    labels = tokens[:, 1:].clone()
    labels[step % GLOBAL_BATCH, : 3 + step % 4] = IGNORE_INDEX  # uneven valid-token counts across ranks
    return tokens[:, :-1], labels


def microbatches(
    step: int, dp_rank: int, dp_size: int, count: int, attention_mask: str = "causal"
) -> list[dict[str, torch.Tensor]]:
    """This dp rank's `count` microbatches of the global batch: microbatch m is row block m * dp_size + dp_rank;
    with their document ids (as the data loader makes them) under block_causal."""
    inputs, labels = global_batch(step)
    batch = {"input_ids": inputs, "labels": labels}
    if attention_mask == "block_causal":
        batch["document_ids"] = document_ids(inputs, BOS_ID)
    size = GLOBAL_BATCH // (dp_size * count)
    blocks = [m * dp_size + dp_rank for m in range(count)]
    return [{key: value[b * size : (b + 1) * size] for key, value in batch.items()} for b in blocks]


def plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def new_state(
    stages: list[StageModule],
    dims: ParallelDims | None = None,
    mesh: ParallelMesh | None = None,
    plan: PipelinePlan | None = None,
    family: str = "llama3",
    options: ParallelizeOptions | None = None,
    converter: Float8Training | MXTraining | None = None,
) -> TrainState:
    """The TrainState the trainer builds for this rank's `stages` in this layout: AdamW per part
    (build_optimizers), warmup schedule, the rank's coordinates and dp reductions, and the trainer's step executor
    (the pipeline schedule over `stages` with a `plan`, else the whole model under the loss-parallel context)."""
    options = options or ParallelizeOptions()
    rank = rank_coordinates(mesh, options.cp_load_balancer)
    layout = ParallelLayout(dims or ParallelDims(1), options, mesh, plan, rank)
    parts = [stage.module for stage in stages]
    optimizer = build_optimizers(parts, Optimizer(lr=1e-2), torch.device("cpu"))
    scheduler = build_lr_scheduler(optimizer, STEPS, LRScheduler(warmup_steps=2))
    executor = build_step_executor(
        family_spec(family), layout, stages, StepLoss.build(layout.dims), torch.device("cpu"),
        converter.optimizer_step_hook if converter else None,
    )
    return TrainState(parts, optimizer, scheduler, NoData(), StepSetup(executor, seed=SEED, max_norm=1.0, rank=rank))


def whole_model(model: torch.nn.Module) -> list[StageModule]:
    """A model that is not pipelined, as the one stage the trainer's model builder makes of it."""
    return [StageModule(0, model)]


def run_steps(
    state: TrainState, steps: range, mesh: ParallelMesh | None, accumulation: int, attention_mask: str = "causal"
) -> dict:
    """The real train_step on the global batches of `steps`: losses, grad norms and LRs (floats), and this
    rank's memory footprint after the first of them."""
    dp_rank, dp_size = dp_rank_and_size(mesh)
    losses, norms, rates, aux_losses, memory = [], [], [], [], None
    for step in steps:
        metrics = train_step(state, microbatches(step, dp_rank, dp_size, accumulation, attention_mask))
        losses.append(plain(metrics["loss"]).item())
        if "aux_loss" in metrics:
            aux_losses.append(metrics["aux_loss"].item())
        norms.append(plain(metrics["grad_norm"]).item())
        rates.append(float(metrics["lr"]))
        if memory is None:
            parts = zip(state.model_parts, state.optimizer.optimizers)
            footprints = [memory_footprint(part, optimizer) for part, optimizer in parts]
            memory = sum(footprints[1:], footprints[0])
    return {"losses": losses, "grad_norms": norms, "lrs": rates, "aux_losses": aux_losses, "memory": memory}


def single_process_run(
    args, family: str = "llama3", attention_mask: str = "causal", float8: dict | None = None,
    param_dtype: str = "float32", mx: dict | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The baseline: the plain single-device recipe (meta, to_empty, seed, init_weights), no parallelize code
    (float8 linears too when `float8` holds [quantize.linear.float8] keys; the forward under autocast to
    `param_dtype`, as one process computes in a run's dtype).

    Returns its run (each global batch as 2 accumulated microbatches) and its initial weights.
    """
    converter = low_precision(float8, mx, ParallelDims(1))
    with torch.device("meta"):
        model = family_spec(family).model.model_cls(args)
    if converter is not None:
        converter.convert(model)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    autocast_forward(model, "cpu", getattr(torch, param_dtype))
    state = new_state(whole_model(model), family=family, converter=converter)
    return run_steps(state, range(STEPS), None, accumulation=2, attention_mask=attention_mask), initial


def mesh_for(dims: ParallelDims, meshes: dict) -> ParallelMesh:
    """The world's mesh for `dims`, built once per shape in a world (every build creates process groups)."""
    key = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.ep)
    if key not in meshes:
        meshes[key] = build_mesh(dims, "cpu")
    return meshes[key]


def build_parallel_model(
    args,
    dims: ParallelDims,
    mesh: ParallelMesh,
    options: ParallelizeOptions | None = None,
    family: str = "llama3",
    converter: Float8Training | MXTraining | None = None,
) -> torch.nn.Module:
    """A whole model as the trainer builds it: on meta, (float8-converted,) parallelized, materialized, with the
    single-device init."""
    spec = family_spec(family)
    with torch.device("meta"):
        model = spec.model.model_cls(args)
    if converter is not None:
        converter.convert(model)
    reference = copy.deepcopy(model)
    spec.parallelize(model, mesh, dims, options or ParallelizeOptions())
    model.to_empty(device="cpu")
    init_weights_like_single_device(model, reference, SEED)
    return model


WATCHED_PARAMS = (
    "tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.q_norm.weight", "norm.weight",
    "output.weight", "layers.0.moe.experts.w1",
)


def run_layout(layout: Layout, world_size: int, meshes: dict) -> tuple[dict, dict, dict]:
    """Train `layout`; also return its initial weights (whole) and the placements of WATCHED_PARAMS."""
    dims = ParallelDims(world_size, **layout.degrees)
    mesh = mesh_for(dims, meshes)
    options = ParallelizeOptions(**layout.options)
    converter = low_precision(layout.float8, layout.mx, dims)
    model = build_parallel_model(layout.args, dims, mesh, options, layout.family, converter)
    initial = {name: plain(p.detach()).clone() for name, p in model.named_parameters()}
    placements = {
        model_fqn(name): str(getattr(p, "placements", "plain"))
        for name, p in model.named_parameters()
        if model_fqn(name) in WATCHED_PARAMS
    }
    state = new_state(whole_model(model), dims, mesh, family=layout.family, options=options, converter=converter)
    seen_dtypes: set[str] = set()
    # A Python side effect in a hook would break a compiled block's graph: watch uncompiled layouts only.
    watch = None if options.compile_model else first_query_projection(model).register_forward_hook(
        lambda module, args, output: seen_dtypes.add(str(output.dtype))
    )
    result = run_steps(state, range(STEPS), mesh, layout.microbatches, layout.attention_mask)
    if watch is not None:
        watch.remove()
        result["matmul_dtypes"] = seen_dtypes
    return result, initial, placements


def first_query_projection(model: torch.nn.Module) -> torch.nn.Module:
    """The first block's query projection: its output dtype is the dtype the layout's matmuls compute in."""
    return next(module for name, module in model.named_modules() if model_fqn(name) == "layers.0.attention.wq")


def run_layouts(rank: int, world_size: int, layouts: list[Layout]) -> dict:
    """Rank 0's report: {"reference": {Layout.reference: run}, layout name: run + init_max_diff, param_names,
    placements}.

    Compiled layouts start from a clean dynamo state and also report what compiling did.
    """
    # Only rank 0 reports, so only rank 0 pays for the single-process baseline (the others would compete for
    # the same few cores).
    wanted = {layout.reference: layout for layout in layouts}
    references = (
        {
            key: single_process_run(
                layout.args, layout.family, layout.attention_mask, layout.float8, layout.param_dtype, layout.mx
            )
            for key, layout in wanted.items()
        }
        if rank == 0
        else {}
    )
    report = {"reference": {key: {**run, "param_names": sorted(init)} for key, (run, init) in references.items()}}
    meshes: dict = {}
    for layout in layouts:
        compiled = layout.options.get("compile_model", False)
        if compiled:
            # The compile report is cumulative over the process; start each compiled layout from zero.
            torch._dynamo.reset()
            torch._dynamo.utils.clear_compilation_metrics()
            torch._dynamo.utils.counters.clear()
        result, initial, placements = run_layout(layout, world_size, meshes)
        if compiled:
            stop_compile_trace()
            result["compile"] = collect_compile_report()
        if rank != 0:
            continue
        expected = references[layout.reference][1]
        result["init_max_diff"] = max(
            (initial[name] - expected[model_fqn(name)]).abs().max().item() for name in initial
        )
        result["param_names"] = sorted(model_fqn(name) for name in initial)
        result["placements"] = placements
        report[layout.name] = result
    return report


def max_relative_diff(values: list[float], expected: list[float]) -> float:
    return max(abs(v - e) / abs(e) for v, e in zip(values, expected, strict=True))


def assert_matches_single_process(
    report: dict, layout: Layout, loss_rtol: float = 1e-5, grad_norm_rtol: float | None = None
) -> None:
    """Same initial weights (exactly), same losses (and auxiliary losses) and gradient norms over STEPS steps (by
    default within 10x the loss tolerance; float8 and MX: see FLOAT8_GRAD_NORM_RTOL), same parameter names."""
    result, reference = report[layout.name], report["reference"][layout.reference]
    assert result["init_max_diff"] == 0.0
    assert len(result["losses"]) == STEPS
    assert max_relative_diff(result["losses"], reference["losses"]) <= loss_rtol
    assert len(result["aux_losses"]) == len(reference["aux_losses"])
    if reference["aux_losses"]:
        assert max_relative_diff(result["aux_losses"], reference["aux_losses"]) <= loss_rtol
    if grad_norm_rtol is None:
        low_precision_layout = layout.float8 is not None or layout.mx is not None
        grad_norm_rtol = FLOAT8_GRAD_NORM_RTOL if low_precision_layout else 10 * loss_rtol
    assert max_relative_diff(result["grad_norms"], reference["grad_norms"]) <= grad_norm_rtol
    assert result["losses"][-1] < result["losses"][0]
    assert result["param_names"] == reference["param_names"]


def parity_tests(world_size: int, layouts: list[Layout]):
    """What every parity test module has: one world of `world_size` ranks that runs all `layouts` (a module
    fixture, so the spawn is paid once), and a test per layout against the single-process run. Bind both names at
    module level so that pytest finds them::

        report, test_layout_matches_single_process = parity_tests(2, LAYOUTS)
    """
    import pytest
    from dist_harness import run_world

    @pytest.fixture(scope="module")
    def report():
        return run_world(world_size, run_layouts, layouts)

    @pytest.mark.parametrize("layout", layouts, ids=lambda layout: layout.name)
    def test_layout_matches_single_process(report, layout):
        assert_matches_single_process(report, layout, *layout.tolerances)

    return report, test_layout_matches_single_process
