"""What the log says about the parallel layout: its degrees in one line, the TP plan and the pipeline split, the
memory footprint of this rank, the dtype MFU is measured against, and step metrics made whole for the logger."""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtrain.parallelize import FamilySpec, format_tp_plan, memory_footprint
from dtrain.parallelize.pipeline_bubble import format_bubbles
from dtrain.run.layout import ParallelLayout

logger = logging.getLogger("dtrain")

# Module-name atoms of wrappers around blocks (activation checkpointing, torch.compile).
WRAPPER_ATOMS = ("_checkpoint_wrapped_module", "_orig_mod")


def describe_layout(layout: ParallelLayout) -> str:
    """The processes and the kinds of parallelism in one phrase, for the start-up line."""
    d = layout.dims
    if d.world_size == 1:
        return "1 process"
    kinds = [
        name
        for name, on in (
            (f"PP {layout.plan.schedule}" if layout.plan else "PP", d.pp > 1),
            ("HSDP", d.hsdp_enabled),
            ("FSDP", d.fsdp_enabled and not d.hsdp_enabled),
            ("DDP", d.ddp_enabled),
            ("CP", d.cp_enabled),
            ("TP+SP" if d.sequence_parallel_enabled else "TP", d.tp_enabled),
            ("EP", d.ep_enabled),
        )
        if on
    ]
    # Expert parallel borrows its ranks from dp_shard × cp, so it is not a factor of the world size.
    experts = f"; experts over ep {d.ep} × efsdp {d.efsdp}" if d.ep_enabled else ""
    return (
        f"{d.world_size} processes ({' + '.join(kinds)}: pp {d.pp} × dp_replicate {d.dp_replicate}"
        f" × dp_shard {d.dp_shard}{f' × cp {d.cp}' if d.cp_enabled else ''} × tp {d.tp}{experts})"
    )


def log_parallel_plans(family: FamilySpec, layout: ParallelLayout, model_parts: list[nn.Module]) -> None:
    """The tensor-parallel plan and the pipeline split, so that a run's log says how the model is laid out."""
    dims = layout.dims
    if dims.tp_enabled:
        plan = family.tp_plan(
            sequence_parallel=dims.sequence_parallel_enabled, loss_parallel=dims.loss_parallel_enabled
        )
        # The family's plan covers all its variants (dense and MoE blocks); the log shows the entries this rank's
        # model has.
        names = module_paths(model_parts)
        applied = {path: style for path, style in plan.items() if any(path_matches(path, n) for n in names)}
        logger.info("tensor-parallel plan:\n%s", format_tp_plan(applied))
    if layout.plan is not None:
        logger.info(layout.plan.describe())
        logger.info(format_bubbles(layout.plan))


def module_paths(model_parts: list[nn.Module]) -> set[tuple[str, ...]]:
    """Every module's dotted name, as atoms, without the wrappers activation checkpointing and compile add after
    tensor parallel was applied (the names the plan was written for)."""
    return {
        tuple(atom for atom in name.split(".") if atom not in WRAPPER_ATOMS)
        for part in model_parts
        for name, _ in part.named_modules()
    }


def path_matches(plan_path: str, name: tuple[str, ...]) -> bool:
    """Whether a plan path (fnmatch patterns per atom, as parallelize_module reads them) names module `name`."""
    atoms = plan_path.split(".")
    return len(atoms) == len(name) and all(fnmatch.fnmatch(n, a) for a, n in zip(atoms, name))


def log_memory(model_parts: list[nn.Module], optimizer) -> None:
    """Parameters, gradients and optimizer state this rank holds (after a step, when all of them exist)."""
    footprints = [memory_footprint(part, opt) for part, opt in zip(model_parts, optimizer.optimizers)]
    logger.info("memory on this rank: %s", sum(footprints[1:], footprints[0]).format())


def compute_dtype(layout: ParallelLayout) -> torch.dtype:
    """The matmul dtype (for the MFU peak and activation sizes): the run's mixed-precision param dtype, which every
    layout computes in (FSDP by its policy, the others under autocast)."""
    return getattr(torch, layout.options.param_dtype)


def whole_metrics(metrics: dict) -> dict:
    """Step metrics as plain tensors for the logger (a DTensor grad norm is made whole here)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in metrics.items()}
