"""Checks of [fault_tolerance]: replica ids and group counts (the config alone), the lighthouse's address (the
config and the environment, before the run).

What needs the network (the lighthouse answering) or the live groups (two groups under one replica id) is checked
when the run joins them (fault_tolerance/replica_groups.py). Any layout runs inside a group, HSDP included: the
groups are one more replicated dimension, outside the mesh.
"""

from __future__ import annotations

import importlib.util
import os

from dtrain.config.schema import JobConfig
from dtrain.config.schema_opt_in import FaultTolerance
from dtrain.errors import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def lighthouse_address(ft: FaultTolerance, env=os.environ) -> str:
    """fault_tolerance.lighthouse, else $TORCHFT_LIGHTHOUSE (torchft's and torchtitan's variable)."""
    return ft.lighthouse or env.get(LIGHTHOUSE_ENV, "")


def check_fault_tolerance(cfg: JobConfig) -> None:
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "fault_tolerance.enable needs torchft, which is not installed: pip install -e '.[ft]' (torchft==0.2.0)"
        )
    if ft.group_size < 1:
        raise ConfigError(
            "fault_tolerance.group_size must name the number of replica groups (1 or more) with "
            "fault_tolerance.enable; got 0"
        )
    if ft.replica_id >= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id {ft.replica_id} is outside [0, fault_tolerance.group_size = {ft.group_size}):"
            " give each group its own id below group_size"
        )
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size {ft.min_replica_size} is more than the {ft.group_size} replica "
            f"groups (fault_tolerance.group_size): no step could ever commit; use 1 to {ft.group_size}"
        )
    if ft.outer_momentum >= 1:
        # Nesterov momentum at 1 or more never decays: the outer updates grow without bound.
        raise ConfigError(f"fault_tolerance.outer_momentum must be in [0, 1); got {ft.outer_momentum:g}")
    if ft.semi_sync_method and cfg.training.skip_nonfinite_steps:
        raise ConfigError(
            f"training.skip_nonfinite_steps must be 0 with fault_tolerance.semi_sync_method = {ft.semi_sync_method}:"
            " a skipped step would move this group's synchronizations off the other groups'"
        )


def check_replica_launch(cfg: JobConfig, cuda: bool, env=os.environ) -> None:
    """What a fault-tolerant launch needs of where it runs: its lighthouse named (in the config or the environment)
    and, for NCCL between the groups, CUDA."""
    if not cfg.fault_tolerance.enable:
        return
    if cfg.fault_tolerance.process_group == "nccl" and not cuda:
        raise ConfigError("fault_tolerance.process_group = nccl needs CUDA GPUs; this run is on the CPU: use gloo")
    if not lighthouse_address(cfg.fault_tolerance, env):
        raise ConfigError(
            f"fault_tolerance.enable needs torchft's lighthouse: set fault_tolerance.lighthouse or {LIGHTHOUSE_ENV} "
            "(e.g. http://localhost:29510; scripts/ft_local.sh starts one)"
        )
