"""The device mesh: one named dimension per parallelism, plus the flattened views the trainer needs.

Dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``. All are always present, size 1
included, so code can ask for ``mesh["tp"]`` without checking whether TP is on; a size-1 dimension costs one
trivial process group. Pipeline stages talk point to point and least often, so ``pp`` is outermost (across
nodes); TP, the chattiest, is innermost (within a node). Flattened views, kept by ``ParallelMesh`` itself (torch deprecates looking a flattened
dimension up on the root mesh):
- ``dp`` = dp_replicate × dp_shard: the ranks that see different data (batch splitting, loss and metric sums).
FSDP shards over ``dp_shard`` (HSDP: the 2-D ``(dp_replicate, dp_shard)``). When context parallel arrives, its
ranks also shard parameters: FSDP will then use a flattened ``dp_shard_cp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.parallelize.parallel_dims import ParallelDims

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelMesh:
    """The world mesh and its flattened views; ``mesh[name]`` gives any of them as a DeviceMesh."""

    world: DeviceMesh
    dp: DeviceMesh

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        return self.dp if names == "dp" else self.world[names]


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh | None:
    """The world's mesh (needs an initialised process group), or None for a single process."""
    if dims.world_size == 1:
        return None
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
    if dims.dp_shard > 1 and dims.tp > 1:
        # Gradients of FSDP x TP parameters are sharded over both; with this flattened view, DTensor reduces
        # their norm (gradient clipping) in one all-reduce instead of two in sequence.
        world["dp_shard", "tp"]._flatten("dp_shard_tp")
    return ParallelMesh(world=world, dp=world["dp_replicate", "dp_shard"]._flatten("dp"))


def fsdp_mesh(mesh: ParallelMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh fully_shard applies to: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP."""
    return mesh["dp_replicate", "dp_shard"] if dims.hsdp_enabled else mesh["dp_shard"]
