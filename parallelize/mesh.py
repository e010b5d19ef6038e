"""The device mesh: one named dimension per parallelism, plus the flattened views the trainer needs.

Dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, all always present (size 1
included), so code can ask for ``mesh["tp"]`` without checking whether TP is on. ``ParallelMesh`` keeps the
flattened views itself (torch deprecates looking a flattened dimension up on the root mesh): ``dp`` (batch
splitting), ``dp_cp`` (loss and token-count sums), ``dp_shard_cp`` (what FSDP shards over; HSDP: the 2-D
``(dp_replicate, dp_shard_cp)``). With expert parallel, ``dp_shard_cp`` is also seen as ``experts`` =
``(efsdp, ep)`` (under HSDP ``dp_cp`` as ``(dp_replicate, efsdp, ep)``, expert weights HSDP-sharded over
``experts_fsdp``).

Why this order and what each view is for: docs/parallelism.md, "How they compose" and "Expert parallel".
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtrain.parallelize.parallel_dims import ParallelDims

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelMesh:
    """The world mesh and its flattened views; ``mesh[name]`` gives any of them as a DeviceMesh."""

    world: DeviceMesh
    views: dict[str, DeviceMesh]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        return self.views[names] if isinstance(names, str) and names in self.views else self.world[names]


def _flat(world: DeviceMesh, names: tuple[str, ...], name: str) -> DeviceMesh:
    """The dimensions `names` of `world` as one; a single dimension as itself (no new process group)."""
    sizes = [world[n].size() for n in names]
    if sum(size > 1 for size in sizes) <= 1:
        big = [n for n, size in zip(names, sizes) if size > 1]
        return world[big[0] if big else names[-1]]
    return world[names]._flatten(name)


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh | None:
    """The world's mesh (needs an initialised process group), or None for a single process."""
    if dims.world_size == 1:
        return None
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
    if dims.dp_shard > 1 and dims.tp > 1 and dims.cp == 1:
        # Gradients of FSDP x TP parameters are sharded over both; with this flattened view, DTensor reduces
        # their norm (gradient clipping) in one all-reduce instead of two in sequence.
        world["dp_shard", "tp"]._flatten("dp_shard_tp")
    views = {
        "dp": world["dp_replicate", "dp_shard"]._flatten("dp"),
        "dp_cp": _flat(world, ("dp_replicate", "dp_shard", "cp"), "dp_cp"),
        "dp_shard_cp": _flat(world, ("dp_shard", "cp"), "dp_shard_cp"),
    }
    if dims.hsdp_enabled and dims.cp > 1:
        # HSDP over (dp_replicate, dp_shard x cp): a 2-D mesh whose second dimension is itself flattened.
        views["hsdp"] = views["dp_cp"]._unflatten(
            0, (dims.dp_replicate, dims.dp_shard * dims.cp), ("dp_replicate", "dp_shard_cp")
        )
    else:
        views["hsdp"] = world["dp_replicate", "dp_shard"]
    if dims.ep_enabled:
        # Expert parallel borrows ep of the dp_shard × cp ranks (consecutive ones, so that an all-to-all stays
        # within the closest ranks); expert weights are FSDP-sharded over the rest ("efsdp"), and under HSDP
        # replicated over dp_replicate as well.
        if dims.hsdp_enabled:
            shape, names = (dims.dp_replicate, dims.efsdp, dims.ep), ("dp_replicate", "efsdp", "ep")
            experts = views["dp_cp"]._unflatten(0, shape, names)
            views["experts_fsdp"] = experts["dp_replicate", "efsdp"]
        else:
            experts = views["dp_shard_cp"]._unflatten(0, (dims.efsdp, dims.ep), ("efsdp", "ep"))
            views["experts_fsdp"] = experts["efsdp"]
        views.update(experts=experts, ep=experts["ep"], efsdp=experts["efsdp"])
    return ParallelMesh(world=world, views=views)


def fsdp_mesh(mesh: ParallelMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh fully_shard applies to: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP."""
    return mesh["hsdp"] if dims.hsdp_enabled else mesh["dp_shard_cp"]
