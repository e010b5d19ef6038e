"""Each replica group's share of the data: the job's global batch has a slot for every group of
fault_tolerance.group_size, group g's data-parallel ranks after those of groups 0..g-1 (as the ranks of plain HSDP
are laid out). A lost group's slots are skipped while it is away (no other group reads them); since the loader's
position is global, a recovered group continues at the others' position with its own slots."""

from __future__ import annotations

from dataclasses import replace

from dtrain.config.schema_opt_in import FaultTolerance
from dtrain.step.state import RankCoordinates


def data_slot(rank: RankCoordinates, ft: FaultTolerance) -> tuple[int, int]:
    """(index, count) of this rank's slot among the job's data-parallel slots."""
    if not ft.enable:
        return rank.dp_rank, rank.dp_size
    return ft.replica_id * rank.dp_size + rank.dp_rank, ft.group_size * rank.dp_size


def job_rank_coordinates(rank: RankCoordinates, ft: FaultTolerance) -> RankCoordinates:
    """`rank` with random streams keyed by its slot in the job, so that groups draw different dropout masks."""
    if not ft.enable:
        return rank
    return replace(rank, rng_coords=("dp", data_slot(rank, ft)[0]))
