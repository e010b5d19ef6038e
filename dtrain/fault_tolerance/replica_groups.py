"""This process's place among the replica groups of a fault-tolerant run: the two ways a step is synchronised with
them (step/replica_sync.py's ReplicaSync), each chosen once per run: `PerStepGroups` (a quorum, sums and a commit
vote every step) and `SemiSyncGroups` (LocalSGD / DiLoCo: the quorum is the synchronization's, in semi_sync.py).

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
import socket
import time
import urllib.parse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from dtrain.config.fault_tolerance_checks import lighthouse_address
from dtrain.config.schema import Comm
from dtrain.config.schema_opt_in import FaultTolerance
from dtrain.errors import first_line
from dtrain.fault_tolerance.gradient_sum import sum_gradients
from dtrain.fault_tolerance.quorum_members import QuorumLost, QuorumMembers, ReplicaError
from dtrain.step.replica_sync import OneGroup
from dtrain.step.state import TrainState

logger = logging.getLogger("dtrain")
LIGHTHOUSE_CONNECT_SECONDS = 10


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


class LiveRecovery:
    """torchft's load_state_dict: the state of a live peer, taken when this group was behind; counted (and, at a
    semi-synchronous synchronization, where no step start sees it, said)."""

    def __init__(self, state: TrainState, replica_id: int, say_each: bool) -> None:
        self.state, self.replica_id, self.say_each = state, replica_id, say_each
        self.loads = 0
        self.seconds = 0.0  # loading only (the transfer is the quorum's)

    def load(self, state_dict: dict) -> None:
        started = time.monotonic()
        self.state.load_state_dict(state_dict)
        self.loads += 1
        self.seconds += time.monotonic() - started
        if self.say_each:
            logger.info("replica group %d: recovered live at step %d from a peer at a synchronization (%.2f s to "
                        "load)", self.replica_id, self.state.step, time.monotonic() - started)


class WaitingForGroups(Exception):
    """What a group reports to torchft to discard its attempts while the job's groups are not all up yet."""


class PerStepGroups:
    """A quorum, token and gradient sums and a commit vote every step (ReplicaSync).

    A group's first step waits for fault_tolerance.group_size groups (its attempts are discarded meanwhile), up to
    fault_tolerance.join_timeout_seconds: a job whose groups start one after the other, or all again after a
    whole-job restart, never trains a step on part of the batch because one group was first. A group that joins a
    running job recovers live instead and does not wait. A lost quorum (the lighthouse gone) discards the attempt
    and is kept in `lost`: the loop saves the state and ends the group with it (run/loop_hooks.py)."""

    may_discard = True

    def __init__(self, manager, recovery: LiveRecovery, ft: FaultTolerance, store: dist.TCPStore) -> None:
        self.manager, self.recovery, self.store = manager, recovery, store
        self.replica_id, self.group_size = ft.replica_id, ft.group_size
        self.min_replica_size, self.join_timeout = ft.min_replica_size, ft.join_timeout_seconds
        self.participants = 0
        self.lost: Exception | None = None
        self.recovery_seconds = 0.0
        self.discarded_steps = 0
        self.joined = False  # committed a step or recovered live: the wait for every group is over
        self._join_deadline: float | None = None
        self._discarding = 0  # discarded attempts since the last step done
        self._first_discard = 0.0

    def start_step(self) -> bool:
        started, loads = time.monotonic(), self.recovery.loads
        try:
            self.manager.start_quorum()
        except QuorumLost as lost:
            self.lost = lost
            return False
        if self.recovery.loads > loads:
            self.joined = True
            self.recovery_seconds += time.monotonic() - started
            logger.info("replica group %d: recovered live at step %d from a peer (%.2f s)",
                        self.replica_id, self.manager.current_step(), time.monotonic() - started)
        self.participants = self.manager.num_participants()
        return True

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    def reduce_gradients(self, parameters: list[nn.Parameter]) -> None:
        sum_gradients(self.manager, parameters)

    def should_commit(self) -> bool:
        waiting = self._waiting_for_groups()
        if waiting:
            self.manager.report_error(WaitingForGroups())
        committed = self.manager.should_commit()
        self._say(committed, waiting)
        self.joined |= committed
        self._discarding = 0 if committed else self._discarding + 1
        self.discarded_steps += not committed
        return committed

    def _waiting_for_groups(self) -> bool:
        if self.joined or self.participants >= self.group_size:
            return False
        now = time.monotonic()
        if self._join_deadline is None:
            self._join_deadline = now + self.join_timeout
        if now < self._join_deadline:
            return True
        logger.warning(
            "replica group %d: only %d of %d replica groups joined within %.0f s (fault_tolerance.join_timeout_seconds)"
            "; training from step %d without the others, assuming they were lost (if they finished the job, stop "
            "this group: it would train past the job's end alone)",
            self.replica_id, self.participants, self.group_size, self.join_timeout, self.manager.current_step() + 1,
        )
        self.joined = True
        return False

    def _say(self, committed: bool, waiting: bool) -> None:
        """One line per run of discarded attempts, and one when the step is done (with how long it stalled)."""
        step = self.manager.current_step() + (0 if committed else 1)
        if not committed and self._discarding == 0:
            self._first_discard = time.monotonic()
            if waiting:
                logger.warning(
                    "replica group %d: step %d discarded (waiting up to %.0f s, fault_tolerance.join_timeout_seconds, "
                    "for all %d replica groups: %d here); it is retried on the same batches",
                    self.replica_id, step, self.join_timeout, self.group_size, self.participants,
                )
            else:
                error = self.manager.errored()
                reason = (first_line(getattr(error, "original_exception", error)) if error is not None else
                          f"fewer than fault_tolerance.min_replica_size = {self.min_replica_size} groups took part")
                logger.warning("replica group %d: step %d discarded (%s); it is retried on the same batches until it "
                               "commits", self.replica_id, step, reason)
        elif committed and self._discarding:
            logger.info("replica group %d: step %d done after %d discarded attempt(s), %.2f s after the first",
                        self.replica_id, step, self._discarding, time.monotonic() - self._first_discard)

    def metrics(self) -> dict[str, float]:
        return {
            "ft/participating_groups": float(self.participants),
            "ft/recoveries": float(self.recovery.loads),
            "ft/recovery_seconds": self.recovery_seconds,
            "ft/discarded_steps": float(self.discarded_steps),
        }

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class SemiSyncGroups(OneGroup):
    """LocalSGD / DiLoCo (semi_sync.py): each group steps alone, as one group does (no sums, every step commits),
    and the quorum is each synchronization's, inside the optimizer's step hooks (ReplicaSync)."""

    def __init__(self, manager, recovery: LiveRecovery, store: dist.TCPStore) -> None:
        self.manager, self.recovery, self.store = manager, recovery, store

    @property
    def participants(self) -> int:  # the groups of the last synchronization (this group alone before its first)
        return max(1, self.manager.num_participants())

    def metrics(self) -> dict[str, float]:
        return {
            "ft/participating_groups": float(self.participants),
            "ft/recoveries": float(self.recovery.loads),
            "ft/recovery_seconds": self.recovery.seconds,
            "ft/discarded_steps": 0.0,
        }

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def join_replica_groups(
    ft: FaultTolerance, comm: Comm, world_rank: int, world_size: int, device: torch.device, state: TrainState
) -> PerStepGroups | SemiSyncGroups:
    """Start this group's Manager (after the state is built and any checkpoint restored: its step is the one
    the quorum compares), then the strategy the run steps with."""
    address = lighthouse_address(ft)
    if world_rank == 0:
        check_lighthouse(address)
    from dtrain.fault_tolerance.manager import build_manager  # torchft is an extra: imported by its runs only

    host, port, store = group_store(world_rank, world_size > 1)
    semi_sync = bool(ft.semi_sync_method)
    recovery = LiveRecovery(state, ft.replica_id, say_each=semi_sync)
    members = QuorumMembers(ft.replica_id, ft.group_size, device)
    manager = build_manager(
        ft, comm, address, members.check, load_state_dict=recovery.load, state_dict=state.state_dict,
        rank=world_rank, world_size=world_size, store_addr=host, store_port=port,
    )
    syncs = state.step // ft.sync_steps if semi_sync else state.step
    manager.load_state_dict({"step": syncs, "batches_committed": 0})
    return SemiSyncGroups(manager, recovery, store) if semi_sync else PerStepGroups(manager, recovery, ft, store)
