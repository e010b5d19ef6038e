"""Estimate a run on paper: per-rank memory, pipeline bubble, communication and step time, for any world size.

The configured model and layout are built on the meta device under a fake process group of `world_size` ranks
(torch's "fake" backend: collectives return at once, nothing is allocated), through the code that training runs:
`build_layout`, `split_model`, the family's `parallelize` and the memory pre-flight's `estimate_memory`. So the
shards, and the parameter, gradient and optimizer-state bytes, are exactly what a run of that layout holds (what
its "memory on this rank" line reports). One rank per pipeline stage is built, since stages differ; the other
dimensions hold equal shares.

Step time (docs/planning.md): the step's FLOPs on one device (with activation recomputation) at the profile's
peak times `matmul_efficiency`; the data-parallel collectives overlap it, the tensor/context/expert/pipeline ones
add to it; the pipeline bubble stretches it. Communication time is bytes over the bandwidth of the group's link
(within a node or across nodes, from the mesh layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from dtrain.config.schema import ActivationCheckpoint, JobConfig, LoRA
from dtrain.data.tokenizer_factory import build_tokenizer
from dtrain.errors import DataError
from dtrain.estimate.communication import Collective, StepShape, intra_node, step_collectives
from dtrain.estimate.hardware import Hardware
from dtrain.models.decoder import DecoderArgs, decoder_layout
from dtrain.models.moe import MoE
from dtrain.parallelize import FamilySpec
from dtrain.parallelize.pipeline_bubble import bubble_fraction
from dtrain.parallelize.pipeline_split import StageModule, split_model
from dtrain.precision.lora import apply_lora
from dtrain.run.hf_start import HFStart
from dtrain.run.layout import ParallelLayout, build_layout, check_layout, parallel_dims
from dtrain.run.memory_preflight import MemoryEstimate, Workload, estimate_memory
from dtrain.run.model_args import base_args, typed_overrides
from dtrain.run.prepare import model_args, model_description, model_family
from dtrain.run.world import World


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[World]:
    """A process group of `world_size` ranks in which this process is `rank`, and nothing communicates."""
    if world_size == 1:
        yield World(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield World(rank=rank, local_rank=0, world_size=world_size, device=torch.device("cpu"))
    finally:
        dist.destroy_process_group()


@dataclass
class StageEstimate:
    """One pipeline stage's rank (every rank of the stage holds the same)."""

    stage: int
    rank: int
    memory: MemoryEstimate
    collectives: list[Collective]
    local_param_elements: int

    @property
    def comm_bytes(self) -> dict[str, float]:
        return {c.name: c.bytes for c in self.collectives}


@dataclass
class Estimate:
    world_size: int
    hardware: Hardware
    description: str
    stages: list[StageEstimate]
    bubble_fraction: float
    flops_per_token: int
    tokens_per_step: int
    step_time_s: float
    compute_time_s: float
    comm_time_s: dict[str, float]
    model_args: DecoderArgs | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def busiest(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.memory.total)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step_time_s / self.world_size

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.hardware.memory_gib * 2**30)

    @property
    def fits(self) -> bool:
        """Whether every rank's estimated peak is within the device's memory."""
        return self.busiest.memory.total <= self.memory_budget_bytes

    @property
    def exposed_comm_s(self) -> float:
        """The communication that adds to the step (not overlapped with compute)."""
        return sum(self.comm_time_s[c.name] for c in self.busiest.collectives if not c.overlapped)

    def mfu(self, dtype: str) -> float:
        return self.flops_per_token * self.tokens_per_s_per_device / self.hardware.peak_flops(dtype)

    def to_json(self, dtype: str) -> dict[str, Any]:
        """The report's numbers: bytes per rank for the most loaded rank, then per pipeline stage."""
        def memory(stage: StageEstimate) -> dict[str, Any]:
            m = stage.memory
            return {
                "params_bytes": m.params, "grads_bytes": m.grads, "grad_buckets_bytes": m.grad_buckets,
                "optimizer_bytes": m.optimizer,
                "activation_bytes": m.activations, "gathered_params_bytes": m.gathered, "batch_bytes": m.batches,
                "total_bytes": m.total,
            }

        return {
            **memory(self.busiest),
            "world_size": self.world_size,
            "hardware": self.hardware.name,
            "layout": self.description,
            "device_memory_bytes": self.memory_budget_bytes,
            "fits": self.fits,
            "bubble_fraction": self.bubble_fraction,
            "comm_bytes_per_step": self.busiest.comm_bytes,
            "comm_time_s": self.comm_time_s,
            "compute_time_s": self.compute_time_s,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu(dtype),
            "stages": [{"stage": s.stage, "rank": s.rank, **memory(s), "comm_bytes_per_step": s.comm_bytes}
                       for s in self.stages],
            "notes": self.notes,
        }


def recompute_factor(ac: ActivationCheckpoint) -> float:
    """The step's FLOPs over a step without recomputation: full AC runs every layer's forward twice (forward is
    a third of a layer's training FLOPs); selective AC every Nth layer's; by-op AC recomputes the cheap ops."""
    if ac.mode == "full":
        return 4 / 3
    if ac.mode == "selective" and ac.selective_ac_option.isdigit():
        return 1 + 1 / (3 * int(ac.selective_ac_option))
    return 1.0


def ac_description(ac: ActivationCheckpoint) -> str:
    """The AC mode as the report names it: selective AC with its option (every Nth block, or by op)."""
    if ac.mode != "selective":
        return ac.mode
    option = ac.selective_ac_option
    return f"selective (1 block in {option})" if option.isdigit() else f"selective by {option}"


def _vocab_size(cfg: JobConfig, family: FamilySpec, start: HFStart | None, notes: list[str]) -> int:
    """The tokenizer's vocabulary, or, when the tokenizer is not on this machine (planning a run before
    downloading anything), the model's own: its flavor's or [model.args]', or that of the config.json it starts
    from."""
    try:
        return build_tokenizer(cfg.model).vocab_size
    except DataError:
        model, m = family.model, cfg.model
        shape = start.args if start is not None else base_args(model, m.flavor, typed_overrides(model, m.args))
        notes.append(f"tokenizer not found at model.hf_assets_path: the model's own vocabulary ({shape.vocab_size})")
        return shape.vocab_size


def estimate(cfg: JobConfig, world_size: int, hardware: Hardware, parts_cache: dict | None = None) -> Estimate:
    """Estimate the run `cfg` describes on `world_size` devices of `hardware`; reads the whole config: it is a
    tool over the whole run. `parts_cache` (a dict shared by estimates of variants of one run, as the advice's
    are) keeps the parallelized model parts between them (`_parallelized_parts`)."""
    notes: list[str] = []
    family, start = model_family(cfg)  # as training resolves them: a run's config.toml may name no flavor
    args = model_args(cfg, family.model, _vocab_size(cfg, family, start, notes), start)
    check_layout(cfg, world_size, family, args)
    dims = parallel_dims(cfg.parallelism, world_size)
    t = cfg.training
    seq_len = t.seq_len
    stages, plan = [], None
    # The device the run will use (it decides whether FSDP's CPU offload moves the states off it).
    device = torch.device("cpu" if hardware.name == "cpu" else "cuda")
    for stage in range(dims.pp):
        rank = stage * (world_size // dims.pp)  # pp is the mesh's outermost dimension
        with fake_world(rank, world_size) as world:
            layout = build_layout(cfg, world, family, args)
            plan = layout.plan
            lora = cfg.lora if cfg.lora.enable else None
            parts = _parallelized_parts(cfg.model.name, family, args, layout, parts_cache, lora)
            # lora.quantize_base: the adapted linears' bases are counted at NF4's bytes (precision/qlora.py)
            workload = Workload.of(cfg.training, cfg.optimizer, layout,
                                   quantize_base=lora is not None and lora.quantize_base)
            memory = estimate_memory(parts, args, layout, workload, device)
            local = sum(_local_numel(p) for part in parts for p in part.parameters())
            blocks = [block for part in parts for block in decoder_layout(part).blocks_of(part).values()]
            moe_layers = sum(1 for block in blocks if any(isinstance(m, MoE) for m in block.modules()))
        fsdp = dims.dp_shard * dims.cp if dims.dp_shard > 1 else 1
        microbatches = workload.microbatches * (plan.n_microbatches if plan else 1)
        mb_sequences = plan.microbatch_size if plan else t.local_batch_size
        shape = StepShape(
            unsharded_param_elements=local * fsdp,
            param_bytes=torch.tensor([], dtype=getattr(torch, t.mixed_precision_param)).element_size(),
            reduce_bytes=torch.tensor([], dtype=getattr(torch, t.mixed_precision_reduce)).element_size(),
            microbatches=microbatches,
            microbatch_tokens=mb_sequences * seq_len,
            dim=args.dim,
            kv_dim=args.n_kv_heads * args.head_dim,
            layers=len(blocks),
            moe_layers=moe_layers,
            top_k=args.moe.top_k if args.moe is not None else 0,
            stages_per_rank=plan.stages_per_rank if plan else 1,
            full_ac=cfg.activation_checkpoint.mode == "full",
        )
        stages.append(StageEstimate(stage, rank, memory, step_collectives(dims, shape), local))
    bubble = bubble_fraction(plan.schedule, dims.pp, plan.n_microbatches, plan.stages_per_rank) if plan else 0.0
    flops_per_token = family.model.flops_per_token(args, seq_len)
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_size
    tokens = global_batch * seq_len
    compute = flops_per_token * tokens / world_size * recompute_factor(cfg.activation_checkpoint)
    compute_s = compute / (hardware.peak_flops(t.mixed_precision_param) * hardware.matmul_efficiency)
    busiest = max(stages, key=lambda s: s.memory.total)
    comm_s: dict[str, float] = {}
    for c in busiest.collectives:
        bandwidth = hardware.bandwidth(intra_node(dims, c.dim, hardware.gpus_per_node))
        comm_s[c.name] = c.bytes / bandwidth
    overlapped = sum(s for c, s in zip(busiest.collectives, comm_s.values()) if c.overlapped)
    exposed = sum(s for c, s in zip(busiest.collectives, comm_s.values()) if not c.overlapped)
    step_s = (max(compute_s, overlapped) + exposed) / (1 - bubble)
    description = (
        f"{model_description(cfg.model, cfg.checkpoint)}, {world_size} x {hardware.name}: dp_replicate "
        f"{dims.dp_replicate}, dp_shard {dims.dp_shard}, tp {dims.tp}, pp {dims.pp}, cp {dims.cp}, ep {dims.ep}; "
        f"global batch {global_batch} x {seq_len}, AC {ac_description(cfg.activation_checkpoint)}, "
        f"{t.mixed_precision_param}"
    )
    return Estimate(world_size, hardware, description, stages, bubble, flops_per_token, tokens, step_s, compute_s,
                    comm_s, args, notes)


def _parallelized_parts(model_name: str, family: FamilySpec, args: DecoderArgs, layout: ParallelLayout,
                        cache: dict | None, lora: LoRA | None = None) -> list[torch.nn.Module]:
    """This rank's model parts, split into its pipeline stages and parallelized, on the meta device: the expensive
    part of an estimate (seconds for a 126-layer model). With `cache`, they are kept by what shapes their
    parameters: the model, the degrees, this rank, the stages and the parallelize options other than activation
    checkpointing and CPU offload, which wrap blocks or move states but change no parameter's shape (the memory
    terms read both from the layout, not from the parts). So a variant that changes only the batch, AC, the
    optimizer or offload is re-estimated without rebuilding, and gives the same numbers as a fresh estimate
    (tests/estimate/test_estimate_advice.py)."""
    key = None
    if cache is not None:
        options = replace(layout.options, ac_mode="none", selective_ac_option="2", memory_budget=0.5, cpu_offload=False)
        plan = layout.plan
        stages = (plan.schedule, plan.pp, plan.stage_modules) if plan else None
        key = repr((model_name, args, layout.dims, options, stages, layout.rank, lora))
        if key in cache:
            return cache[key]
    with torch.device("meta"):
        model = family.model.model_cls(args)
    if lora is not None:
        apply_lora(model, lora)  # frozen base: the memory terms count gradients and moments of the adapters only
    plan = layout.plan
    pieces = split_model(model, plan, layout.rank.pp_rank) if plan else [StageModule(0, model)]
    parts = [family.parallelize(p.module, layout.mesh, layout.dims, layout.options) for p in pieces]
    if key is not None:
        cache[key] = parts
    return parts


def _local_numel(param: torch.Tensor) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel()
