"""Communication per step on one rank, by collective and mesh dimension, from the layout and the model's shapes.

Bytes are what one rank sends per optimizer step, at the ring algorithms' volumes; which collectives each
dimension runs per microbatch, and which overlap compute: docs/planning.md ("Communication per step").
"""

from __future__ import annotations

from dataclasses import dataclass

OVERLAPPED = ("dp_shard", "dp_replicate")


@dataclass(frozen=True)
class Collective:
    name: str  # what it does, e.g. "fsdp all_gather"
    dim: str  # the mesh dimension it runs over
    group_size: int
    bytes: float  # sent by one rank per step

    @property
    def overlapped(self) -> bool:
        return self.dim in OVERLAPPED


def ring_share(op: str, n: int) -> float:
    """The fraction of the data one rank sends in a ring `op` over `n` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


@dataclass(frozen=True)
class StepShape:
    """What communication volume depends on, for one rank."""

    unsharded_param_elements: int  # this rank's parameters before FSDP sharding (after TP/PP/EP)
    param_bytes: int  # compute dtype bytes (what FSDP gathers)
    reduce_bytes: int  # gradient reduction dtype bytes
    microbatches: int  # per step on this rank (gradient accumulation x pipeline microbatches)
    microbatch_tokens: int  # tokens of one microbatch on this rank, before the context split
    dim: int
    kv_dim: int
    layers: int  # on this rank
    moe_layers: int  # on this rank
    top_k: int
    stages_per_rank: int
    full_ac: bool


def step_collectives(dims, shape: StepShape) -> list[Collective]:
    """Every collective a step runs on this rank, with its bytes (zero-byte ones left out)."""
    found: list[Collective] = []
    a, m = shape.param_bytes, shape.microbatches
    fsdp = dims.dp_shard * dims.cp if dims.dp_shard > 1 else 1
    if fsdp > 1:
        params = shape.unsharded_param_elements
        gathers = m * 2 * ring_share("all_gather", fsdp) * params * a
        found.append(Collective("fsdp all_gather (params)", "dp_shard", fsdp, gathers))
        scatters = m * ring_share("reduce_scatter", fsdp) * params * shape.reduce_bytes
        found.append(Collective("fsdp reduce_scatter (grads)", "dp_shard", fsdp, scatters))
        if dims.dp_replicate > 1:
            shard = params / fsdp
            reduce = m * ring_share("all_reduce", dims.dp_replicate) * shard * shape.reduce_bytes
            found.append(Collective("hsdp all_reduce (grads)", "dp_replicate", dims.dp_replicate, reduce))
    elif dims.dp_replicate > 1:
        reduce = ring_share("all_reduce", dims.dp_replicate) * shape.unsharded_param_elements * shape.reduce_bytes
        found.append(Collective("ddp all_reduce (grads)", "dp_replicate", dims.dp_replicate, reduce))
    activation = shape.microbatch_tokens / dims.cp * shape.dim * a
    if dims.tp > 1:
        forward_passes = 2 if shape.full_ac else 1  # full AC runs the forward again in backward
        if dims.sequence_parallel:
            count = 4 * forward_passes + 4
            volume = count * ring_share("all_gather", dims.tp) * activation
        else:
            count = 2 * forward_passes + 2
            volume = count * ring_share("all_reduce", dims.tp) * activation
        name = "tp all_gather/reduce_scatter (activations)" if dims.sequence_parallel else "tp all_reduce (activations)"
        found.append(Collective(name, "tp", dims.tp, m * shape.layers * volume))
    if dims.cp > 1:
        keys_values = shape.microbatch_tokens * 2 * shape.kv_dim / dims.tp * a
        volume = 2 * ring_share("all_gather", dims.cp) * keys_values
        found.append(Collective("cp all_gather/reduce_scatter (keys, values)", "cp", dims.cp, m * shape.layers * volume))
    if dims.ep > 1 and shape.moe_layers:
        routed = shape.microbatch_tokens / dims.cp * shape.top_k * shape.dim * a
        volume = 4 * ring_share("all_to_all", dims.ep) * routed
        found.append(Collective("ep all_to_all (tokens)", "ep", dims.ep, m * shape.moe_layers * volume))
    if dims.pp > 1:
        sends = m * 2 * shape.stages_per_rank * activation / dims.tp
        found.append(Collective("pp send/recv (activations)", "pp", dims.pp, sends))
    return [c for c in found if c.bytes > 0]


# Mesh dimensions from the innermost (consecutive ranks) out, as parallelize/mesh.py lays them out.
MESH_ORDER = ("tp", "cp", "dp_shard", "dp_replicate", "pp")


def intra_node(dims, dim: str, devices_per_node: int) -> bool:
    """Whether every group of mesh dimension `dim` lies within one node (its ranks are consecutive blocks)."""
    sizes = {"tp": dims.tp, "cp": dims.cp, "dp_shard": dims.dp_shard, "dp_replicate": dims.dp_replicate,
             "pp": dims.pp, "ep": dims.ep}
    if dim == "ep":  # ep borrows consecutive ranks of dp_shard x cp, inside tp
        return dims.tp * dims.ep <= devices_per_node
    span = 1
    for name in MESH_ORDER:
        span *= sizes[name]
        if name == dim:
            return span <= devices_per_node
    raise ValueError(f"unknown mesh dimension {dim!r}")
