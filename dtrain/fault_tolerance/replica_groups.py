"""This process's place among the replica groups of a fault-tolerant run: torchft's Manager and its reconfigurable
process group, and what the step asks of them (step/replica_sync.py).

Each group is an ordinary dtrain launch (any layout inside it); its rank r meets rank r of the other groups in the
process group that torchft reconfigures at every quorum. A step: the quorum (a group whose step is behind the
others' takes the whole TrainState from a live peer over HTTP: live recovery), the token count and the gradients
summed over the groups, then `should_commit`: a step that failed anywhere is discarded by every group. The quorum
is synchronous (torchft's use_async_quorum=False): a recovering group loads the state before its forward, so it
takes part in the step it joins.

The state sent to a recovering group is the TrainState's own state dict (DCP's get/set_state_dict under any
layout), whose data position is global (the same for every group), so a recovered group continues its own share
of the data exactly where the others are.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.parse
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from dtrain.config.fault_tolerance_checks import lighthouse_address
from dtrain.config.schema import Comm, JobConfig
from dtrain.errors import DtrainError, first_line
from dtrain.fault_tolerance.gradient_sum import sum_gradients
from dtrain.step.state import TrainState

logger = logging.getLogger("dtrain")
LIGHTHOUSE_CONNECT_SECONDS = 10


class ReplicaError(DtrainError):
    """The replica groups cannot work together as configured (a lighthouse that does not answer, two groups
    under one replica id)."""


def check_lighthouse(address: str) -> None:
    """Refuse now, in one line, a lighthouse that does not accept connections (torchft would retry for a minute
    and end in a Rust traceback)."""
    parsed = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    if not parsed.hostname or not parsed.port:
        raise ReplicaError(f"fault_tolerance.lighthouse {address!r} is not an address; give http://host:port")
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=LIGHTHOUSE_CONNECT_SECONDS).close()
    except OSError as err:
        raise ReplicaError(
            f"torchft's lighthouse at {address} does not answer ({err.strerror or err}); start it first "
            "(torchft_lighthouse --min_replicas 1 --bind [::]:29510) or fix fault_tolerance.lighthouse / "
            "TORCHFT_LIGHTHOUSE"
        ) from None


def group_store(world_rank: int, distributed: bool) -> tuple[str, int, dist.TCPStore]:
    """A TCPStore of this group for its Manager, hosted by the group's rank 0 (a world of one has no store of its
    own, and torchrun's may be a file store): its address, port and the handle that keeps it alive. The address
    is the host's name, as the other groups reach it: torchft hands it to them in the quorum."""
    host = socket.gethostname()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if world_rank == 0 else None
    if distributed:
        address = [host, store.port if store is not None else 0]
        dist.broadcast_object_list(address, src=0)
        host, port = address
        return host, port, store or dist.TCPStore(host, port, is_master=False, wait_for_workers=False)
    return host, store.port, store


@dataclass
class ReplicaGroups:
    """The replica groups as the step sees them (step/replica_sync.py's ReplicaSync), and their metrics."""

    manager: object  # torchft.Manager (imported only by fault-tolerant runs)
    replica_id: int
    group_size: int
    semi_sync: bool
    store: dist.TCPStore
    device: torch.device
    participants: int = 0
    recoveries: int = 0
    recovery_seconds: float = 0.0
    discarded_steps: int = 0
    min_replica_size: int = 1
    _recovered: bool = field(default=False, repr=False)
    _discarding: int = field(default=0, repr=False)  # discarded attempts since the last step done

    def load_live_state(self, state: TrainState, state_dict: dict) -> None:
        """torchft's load_state_dict: the state of a live peer, taken when this group was behind."""
        started = time.monotonic()
        state.load_state_dict(state_dict)
        self._recovered = True
        if self.semi_sync:  # the quorum is a synchronization's (not start_step's): count the recovery here
            self.recoveries += 1
            self.recovery_seconds += time.monotonic() - started
            logger.info(
                "replica group %d: recovered live at step %d from a peer at a synchronization (%.2f s to load)",
                self.replica_id, state.step, time.monotonic() - started,
            )

    def start_step(self) -> None:
        if self.semi_sync:  # the quorum is the synchronization's (LocalSGD / DiLoCo), every sync_steps
            return
        start = time.monotonic()
        self._recovered = False
        self.manager.start_quorum()
        if self._recovered:
            self.recoveries += 1
            self.recovery_seconds += time.monotonic() - start
            logger.info(
                "replica group %d: recovered live at step %d from a peer (%.2f s)",
                self.replica_id, self.manager.current_step(), time.monotonic() - start,
            )
        self.participants = self.manager.num_participants()

    def check_unique_ids(self) -> None:
        """torchft makes every group's id unique by a suffix, so two launches with one replica_id would both train
        on the same share of the data: count the groups of each id over the quorum and refuse a repeat."""
        ids = torch.zeros(self.group_size, dtype=torch.float32, device=self.device)
        ids[self.replica_id] = 1
        self.manager.allreduce(ids, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is None and ids.max() > 1:
            repeated = [i for i, n in enumerate(ids.tolist()) if n > 1]
            raise ReplicaError(
                f"fault_tolerance.replica_id {repeated[0]} is used by {int(ids[repeated[0]])} replica groups at once;"
                f" give each group its own id in [0, fault_tolerance.group_size = {self.group_size})"
            )

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.semi_sync:
            return tensor
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> None:
        if not self.semi_sync:
            sum_gradients(self.manager, parameters)

    def should_commit(self) -> bool:
        if self.semi_sync:
            return True
        committed = self.manager.should_commit()
        # Said once per run of discarded steps (a group waiting for min_replica_size groups discards every step).
        if not committed and self._discarding == 0:
            logger.warning(
                "replica group %d: step %d discarded (a group failed during it, or fewer than "
                "fault_tolerance.min_replica_size = %d took part); it is retried on the same batches until it commits",
                self.replica_id, self.manager.current_step() + 1, self.min_replica_size,
            )
        elif committed and self._discarding:
            logger.info("replica group %d: step %d done after %d discarded attempt(s)",
                        self.replica_id, self.manager.current_step(), self._discarding)
        self._discarding = 0 if committed else self._discarding + 1
        self.discarded_steps += not committed
        return committed

    def metrics(self) -> dict[str, float]:
        # Under semi-sync, the groups of the last synchronization (this group alone before its first).
        participants = max(1, self.manager.num_participants()) if self.semi_sync else self.participants
        return {
            "ft/participating_groups": float(participants),
            "ft/recoveries": float(self.recoveries),
            "ft/recovery_seconds": self.recovery_seconds,
            "ft/discarded_steps": float(self.discarded_steps),
        }

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def join_replica_groups(
    cfg: JobConfig, world_rank: int, world_size: int, device: torch.device, state: TrainState
) -> ReplicaGroups:
    """Start this group's Manager (after the state is built and any checkpoint restored: its step is the one
    the quorum compares)."""
    ft = cfg.fault_tolerance
    address = lighthouse_address(cfg)
    if world_rank == 0:
        check_lighthouse(address)
    quiet_torchft()
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    timeout = timedelta(milliseconds=ft.process_group_timeout_ms)
    pg = ProcessGroupNCCL(timeout=timeout) if ft.process_group == "nccl" else ProcessGroupGloo(timeout=timeout)
    host, port, store = group_store(world_rank, world_size > 1)
    groups = ReplicaGroups(
        None, ft.replica_id, ft.group_size, bool(ft.semi_sync_method), store, device,
        min_replica_size=ft.min_replica_size,
    )
    quorum_timeout = timedelta(seconds=cfg.comm.init_timeout_seconds)
    groups.manager = managed_quorums(address, quorum_timeout, groups.check_unique_ids)(
        pg=pg,
        load_state_dict=lambda sd: groups.load_live_state(state, sd),
        state_dict=state.state_dict,
        min_replica_size=ft.min_replica_size,
        use_async_quorum=False,  # the recovered state is loaded before the forward (DiLoCo requires it too)
        timeout=manager_timeout(cfg.comm, timeout),
        quorum_timeout=quorum_timeout,
        connect_timeout=timedelta(seconds=cfg.comm.init_timeout_seconds),
        rank=world_rank,
        world_size=world_size,
        store_addr=host,
        store_port=port,
        lighthouse_addr=address,
        replica_id=f"dtrain_replica_{ft.replica_id}",
        init_sync=False,  # every group initializes the same weights from debug.seed
    )
    syncs = state.step // ft.sync_steps if ft.semi_sync_method else state.step
    groups.manager.load_state_dict({"step": syncs, "batches_committed": 0})
    return groups


def managed_quorums(lighthouse: str, timeout: timedelta, after_quorum: Callable[[], None]) -> type:
    """torchft's Manager whose failed quorum is one line (the groups cannot agree without their lighthouse) and
    that runs `after_quorum` after every quorum: each step's, or each synchronization's under LocalSGD / DiLoCo."""
    from torchft import Manager

    class DtrainManager(Manager):
        def start_quorum(self, *args, **kwargs) -> None:
            try:
                super().start_quorum(*args, **kwargs)
            except Exception as err:  # torchft raises the Rust client's error, with a thread's traceback
                raise ReplicaError(
                    f"the replica groups' quorum failed ({type(err).__name__}: {first_line(err)}) within "
                    f"{timeout.total_seconds():.0f} s (comm.init_timeout_seconds): is torchft's lighthouse at "
                    f"{lighthouse} still running? Without it no group can go on: restart it, then the groups"
                ) from err
            after_quorum()

    return DtrainManager


def quiet_torchft() -> None:
    """torchft's servers log every quorum and commit at INFO (Rust), and its Manager warns at every quorum that
    NCCL's flight recorder cannot be reset: keep their warnings and errors only, unless RUST_LOG says otherwise.
    dtrain logs what a user needs of the groups (joins, recoveries, discarded steps)."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.ERROR)
    # A recovering group reads the peer's state from a received buffer that torch wraps without copying.
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def manager_timeout(comm: Comm, collective: timedelta) -> timedelta:
    """The Manager's timeout covers the commit vote and the transfer of a whole state to a recovering group, so
    it is the longer of the collectives' and the training collectives' (comm.train_timeout_seconds)."""
    return max(collective, timedelta(seconds=comm.train_timeout_seconds))
