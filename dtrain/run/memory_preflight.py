"""Pre-flight memory check: refuse a run whose memory cannot fit, before anything is allocated on the device.

It runs on every rank between ``parallelize`` and ``to_empty``, while the model parts are still on the meta device:
their local shards already have their final shapes, so what this rank will hold is known without holding it. The
estimate's terms and the activation formulas, with how close they come to measured peaks, are in docs/planning.md
("The memory model").
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dtrain.config.low_bit_optim import low_bit_format
from dtrain.config.schema import Optimizer, Training
from dtrain.errors import DtrainError
from dtrain.models.decoder import DecoderArgs, decoder_layout
from dtrain.parallelize import local_shard, memory_footprint
from dtrain.parallelize.activation_checkpoint import parse_selective_option
from dtrain.run.layout import ParallelLayout
from dtrain.run.layout_report import compute_dtype
from dtrain.step.optimizer import kernel_flags, moment_bytes

logger = logging.getLogger("dtrain")

GIB = 1024**3
FP32 = 4
# The bytes of the scalar step count Adam keeps per parameter.
STEP_BYTES = 4
# input_ids and labels, int64 each, per token of a batch; document_ids, under document masking, one more.
BATCH_BYTES_PER_TOKEN = 2 * torch.long.itemsize
DOCUMENT_IDS_BYTES_PER_TOKEN = torch.long.itemsize
# Pipeline schedules that run every microbatch's forward before any backward, so a stage holds all of them.
ALL_FORWARDS_FIRST = ("GPipe", "LoopedBFS")


class InsufficientMemory(DtrainError):
    """The run's estimated memory exceeds what this rank's device (or host) has."""


@dataclass(frozen=True)
class Workload:
    """What this rank's memory depends on besides its model parts and layout (from the config)."""

    local_batch_size: int
    global_batch_size: int
    seq_len: int
    microbatches: int  # per optimizer step (gradient accumulation); the loop holds all of them at once
    optimizer: str
    foreach_step: bool  # the optimizer runs its foreach kernel, whose step makes temporaries
    skip: bool  # training.skip_memory_check: estimate and log, never refuse
    document_masking: bool = False  # training.attention_mask = block_causal: batches carry document_ids
    quantize_base: bool = False  # lora.quantize_base: the LoRA linears' base weights are stored as NF4

    @classmethod
    def of(
        cls, training: Training, optimizer: Optimizer, layout: ParallelLayout, quantize_base: bool = False
    ) -> Workload:
        """The workload of `[training]` and `[optimizer]` on `layout` (`quantize_base`: QLoRA's NF4 base)."""
        device = torch.device(layout.options.device_type)
        return cls(
            local_batch_size=training.local_batch_size,
            global_batch_size=training.global_batch_size,
            seq_len=training.seq_len,
            microbatches=layout.dims.gradient_accumulation_steps(
                training.local_batch_size, training.global_batch_size
            ),
            optimizer=optimizer.name,
            foreach_step=low_bit_format(optimizer.name) is None
            and kernel_flags(optimizer.implementation, device).get("foreach", False),
            skip=training.skip_memory_check,
            document_masking=training.attention_mask == "block_causal",
            quantize_base=quantize_base,
        )

    @property
    def batch_bytes(self) -> int:
        per_token = BATCH_BYTES_PER_TOKEN + DOCUMENT_IDS_BYTES_PER_TOKEN * self.document_masking
        return self.microbatches * self.local_batch_size * self.seq_len * per_token


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak bytes on this rank's device, by what holds them (the module doc says how)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    gathered: int
    optimizer_step: int
    batches: int
    grad_buckets: int = 0  # DDP's flat gradient buckets, beside the gradients

    def terms(self) -> dict[str, int]:
        """What the total is the sum of: activations and the optimizer step's temporaries never coexist."""
        if self.activations + self.gathered >= self.optimizer_step:
            peak = {"activations": self.activations, "gathered params": self.gathered}
        else:
            peak = {"optimizer step": self.optimizer_step}
        states = {"params": self.params, "grads": self.grads, "grad buckets": self.grad_buckets,
                  "optimizer": self.optimizer}
        return {**states, **peak, "batches": self.batches}

    @property
    def total(self) -> int:
        return sum(self.terms().values())

    def format(self) -> str:
        terms = ", ".join(f"{name} {value / GIB:.2f}" for name, value in self.terms().items() if value)
        return f"{self.total / GIB:.2f} GiB ({terms})"


def check_memory(
    parts: list[nn.Module], model_args: DecoderArgs, layout: ParallelLayout, workload: Workload, device: torch.device
) -> None:
    """Estimate this rank's memory from its parallelized (still meta) model parts; refuse in one line what cannot
    fit, on every rank together, unless ``workload.skip``."""
    estimate = estimate_memory(parts, model_args, layout, workload, device)
    host, available = host_memory_bytes(), device_memory_bytes(device)
    refusal = None
    if workload.batch_bytes > host:
        refusal = (
            f"training.global_batch_size={workload.global_batch_size} takes {workload.microbatches} microbatches of "
            f"training.local_batch_size={workload.local_batch_size} x training.seq_len={workload.seq_len} per step "
            f"on this rank, held at once: {workload.batch_bytes / GIB:.2f} GiB, more than the {host / GIB:.2f} GiB "
            f"of host memory available per rank; lower training.global_batch_size or seq_len, or pass "
            f"--training.skip_memory_check"
        )
    elif estimate.total > available:
        refusal = (
            f"estimated memory per rank {estimate.format()} exceeds {device}'s {available / GIB:.2f} GiB; lower "
            f"training.local_batch_size or training.seq_len, set activation_checkpoint.mode (full or selective), "
            f"raise parallelism.data_parallel_shard_degree, or pass --training.skip_memory_check"
        )
    refusal = _first_refusal(refusal, layout)
    if refusal is None:
        logger.info("memory estimate per rank: %s of %.2f GiB on %s", estimate.format(), available / GIB, device)
    elif workload.skip:
        logger.warning("training.skip_memory_check is set, so going on although %s", refusal.split(";")[0])
    else:
        raise InsufficientMemory(refusal)


def _first_refusal(refusal: str | None, layout: ParallelLayout) -> str | None:
    """The first rank's refusal, on every rank: pipeline stages differ, and a rank that went on alone would wait
    in its first collective until the timeout."""
    if layout.mesh is None:
        return refusal
    refusals: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(refusals, refusal)
    return next((r for r in refusals if r is not None), None)


def estimate_memory(
    parts: list[nn.Module], model_args: DecoderArgs, layout: ParallelLayout, workload: Workload, device: torch.device
) -> MemoryEstimate:
    """This rank's peak memory for one training step of `workload` on `layout` (see the module doc)."""
    footprint = sum((memory_footprint(part) for part in parts[1:]), memory_footprint(parts[0]))
    trainable = [p for part in parts for p in part.parameters() if p.requires_grad]
    # FSDP's CPU offload keeps the states (and runs the optimizer step) in host memory, which this check does not size.
    on_device = not (layout.options.cpu_offload and device.type != "cpu")
    grad_bytes = footprint.grad_bytes * on_device
    nf4_saving = 0
    if workload.quantize_base:  # QLoRA's base weights, float on the meta device, are held as NF4 once loaded
        from dtrain.precision.qlora import nf4_base_saving  # torchao is imported only for QLoRA

        nf4_saving = nf4_base_saving(parts)
    return MemoryEstimate(
        params=(footprint.param_bytes - nf4_saving) * on_device,
        grads=grad_bytes,
        grad_buckets=grad_bytes if layout.dims.ddp_enabled else 0,
        optimizer=(sum(moment_bytes(workload.optimizer, p) for p in trainable) + STEP_BYTES * len(trainable))
        * on_device,
        activations=activation_bytes(parts, model_args, layout, workload.local_batch_size, workload.seq_len),
        gathered=gathered_bytes(parts, layout),
        optimizer_step=grad_bytes if workload.foreach_step else 0,
        batches=workload.batch_bytes,
    )


def feed_forward_width(model_args: DecoderArgs, tp: int = 1) -> float:
    """The SwiGLU width a token goes through on one of `tp` tensor-parallel ranks: the dense FFN's split over them,
    or under MoE its ``top_k`` experts' (whole on every TP rank) and the shared experts' (split) together
    (models/moe.py, parallelize/moe_tensor_parallel.py)."""
    moe = model_args.moe
    if moe is None:
        return model_args.ffn_hidden_dim / tp
    return moe.top_k * moe.hidden_dim + moe.num_shared_experts * moe.hidden_dim / tp


def routed_copies(model_args: DecoderArgs, a: int) -> float:
    """Bytes per token an MoE layer keeps besides its experts' matmuls: each token's ``top_k`` copies sorted by
    expert, their outputs, and the outputs put back in token order (0 for a dense model)."""
    moe = model_args.moe
    return 0.0 if moe is None else 3.0 * a * moe.top_k * model_args.dim


def activation_bytes(
    parts: list[nn.Module], model_args: DecoderArgs, layout: ParallelLayout, local_batch_size: int, seq_len: int
) -> int:
    """Peak activation bytes of this rank's `parts` in a step over microbatches of `local_batch_size` sequences of
    `seq_len` tokens (the module doc's formula)."""
    dims, options, plan = layout.dims, layout.options, layout.plan
    a = compute_dtype(layout).itemsize
    tp = dims.tp
    sp = tp if dims.sequence_parallel_enabled else 1
    lp = tp if dims.loss_parallel_enabled else 1
    h, q = model_args.dim, model_args.n_heads * model_args.head_dim
    kv, f = model_args.n_kv_heads * model_args.head_dim, feed_forward_width(model_args, tp)
    norm = (FP32 + a) * h / sp + a * h
    head = norm + 3 * FP32 * model_args.vocab_size / lp
    every_nth = parse_selective_option(options.ac_mode, options.selective_ac_option)
    by_op = options.ac_mode == "selective" and every_nth is None
    kept_if_checkpointed = a * (h / sp + 2 * h + (2 * q + 2 * kv) / tp + 2 * f) if by_op else a * h / sp
    kept, recompute, head_here = 0.0, 0.0, False
    for part in parts:
        decoder = decoder_layout(part)
        qk_norm = (FP32 + a) * (q + kv) / tp if getattr(part, "qk_norm", False) else 0.0
        layer = 2 * norm + a * (4 * q / tp + 4 * f) + qk_norm + routed_copies(model_args, a)
        layer += context_parallel_extra(layout, a, q, kv, seq_len) + attention_mask_extra(layout, a, seq_len)
        n_blocks = len(decoder.blocks_of(part))
        if options.ac_mode == "memory_budget":
            # The partitioner's own choice is not modelled: the budget's share of the way from full AC's input
            # to the whole layer, and backward recomputes the rest of one block at a time.
            budgeted = kept_if_checkpointed + options.memory_budget * (layer - kept_if_checkpointed)
            kept += n_blocks * budgeted
            recompute = layer - budgeted
        else:
            checkpointed = 0 if options.ac_mode == "none" else n_blocks // (every_nth or 1)
            kept += checkpointed * kept_if_checkpointed + (n_blocks - checkpointed) * layer
            if checkpointed:
                recompute = layer + 2 * a * f
        head_here = head_here or decoder.part(part, decoder.head) is not None
    sequences, in_flight = local_batch_size, 1
    if plan is not None:
        sequences = plan.microbatch_size
        in_flight = plan.n_microbatches if plan.schedule in ALL_FORWARDS_FIRST else min(plan.n_microbatches, plan.pp)
    tokens = sequences * seq_len / dims.cp
    return math.ceil(tokens * (in_flight * kept + max(head if head_here else 0.0, recompute)))


def context_parallel_extra(layout: ParallelLayout, a: int, q: int, kv: int, seq_len: int) -> float:
    """Per local token of a layer, what context parallel's attention keeps beyond the per-token keys and values
    (``2 a q / tp``, repeated), by its path (parallelize/context_parallel.py): torch's ring keeps only those (the
    keys and values it rotates in are gone after the layer, and backward rotates them again); the blockwise
    attention keeps the whole sequence's, with their kv heads only (``2 a kv cp / tp``); the masked attention keeps
    them repeated (``2 a q cp / tp``)."""
    cp, tp = layout.dims.cp, layout.dims.tp
    path = layout.options.cp_attention_path
    if cp == 1 or path == "ring":
        return 0.0
    if path == "blockwise":
        return 2 * a * (kv * cp - q) / tp
    return 2 * a * q * (cp - 1) / tp


def attention_mask_extra(layout: ParallelLayout, a: int, seq_len: int) -> float:
    """Per (local) token of a layer, the mask attention keeps for backward where it runs with one: SDPA turns each
    sequence's boolean mask (models/attention.py; context_parallel.py's masked path) into an additive one in the
    compute dtype and saves it, ``a`` bytes per key of the whole sequence (gathered under SP; one mask for all
    heads, so TP does not divide it). Measured on CPU (tests/run/test_memory_preflight.py). FlexAttention's block
    masks (per 128 x 128 tile) keep no such mask."""
    document_masking = layout.options.attention_mask == "block_causal" and not layout.options.flex_attention
    cp_masked = layout.dims.cp > 1 and layout.options.cp_attention_path == "masked"
    return a * seq_len if document_masking or cp_masked else 0.0


def gathered_bytes(parts: list[nn.Module], layout: ParallelLayout) -> int:
    """FSDP's all-gathered block parameters in the compute dtype: two blocks at a time, or every block when they
    are never resharded after forward."""
    if not layout.dims.fsdp_enabled:
        return 0
    blocks = [
        sum(local_shard(p).numel() for p in block.parameters())
        for part in parts
        for block in decoder_layout(part).blocks_of(part).values()
    ]
    held = sum(blocks) if layout.options.reshard_after_forward == "never" else sum(sorted(blocks)[-2:])
    return held * layout.dims.dp_shard * layout.dims.cp * compute_dtype(layout).itemsize


def host_memory_bytes() -> int:
    """This rank's share of the host's available memory: MemAvailable over the ranks on this host."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        line = next(line for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:"))
        available = int(line.split()[1]) * 1024
    else:  # not Linux (a laptop): the physical memory is the best figure without psutil
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return available // ranks_here


def device_memory_bytes(device: torch.device) -> int:
    """The memory of `device`: a GPU's total, or on CPU this rank's share of the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes()
