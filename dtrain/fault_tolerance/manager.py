"""torchft's Manager as dtrain runs it: its quorum failure is one line (the error that ends the group), every quorum
is followed by dtrain's own check of the groups in it, and once the group has had its first quorum the next ones
get the shorter fault_tolerance.quorum_timeout_seconds. Imported only by fault-tolerant runs (torchft is an extra)."""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta
from typing import Callable

from dtrain.config.schema import Comm
from dtrain.config.schema_opt_in import FaultTolerance
from dtrain.errors import first_line
from dtrain.fault_tolerance.quorum_members import QuorumLost

# torchft's Rust servers read RUST_LOG once, when torchft is first imported: INFO would log every quorum and commit.
os.environ.setdefault("RUST_LOG", "warn")
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # noqa: E402


class DtrainManager(Manager):
    def __init__(self, *, lighthouse: str, first_timeout: timedelta, later_timeout: timedelta,
                 after_quorum: Callable[[Manager], None], **manager_args) -> None:
        super().__init__(lighthouse_addr=lighthouse, quorum_timeout=first_timeout, **manager_args)
        self.lighthouse, self.first_timeout, self.later_timeout = lighthouse, first_timeout, later_timeout
        self.after_quorum = after_quorum
        self.had_quorum = False

    def start_quorum(self, *args, **kwargs) -> None:
        # The first quorum waits for groups still starting (comm.init_timeout_seconds); a later one only for the
        # lighthouse to answer, so a lost lighthouse ends the group soon, after it saved.
        timeout = self.later_timeout if self.had_quorum else self.first_timeout
        kwargs.setdefault("timeout", timeout)
        try:
            super().start_quorum(*args, **kwargs)
        except Exception as err:  # torchft raises the Rust client's error, with a thread's traceback
            key = "fault_tolerance.quorum_timeout_seconds" if self.had_quorum else "comm.init_timeout_seconds"
            raise QuorumLost(
                f"the replica groups' quorum failed ({type(err).__name__}: {first_line(err)}) within "
                f"{timeout.total_seconds():.0f} s ({key}): is torchft's lighthouse at {self.lighthouse} still "
                "running? Without it no group can go on"
            ) from err
        self.had_quorum = True
        self.after_quorum(self)


def build_manager(ft: FaultTolerance, comm: Comm, lighthouse: str, after_quorum: Callable[[Manager], None],
                  **manager_args) -> DtrainManager:
    """This group's Manager over the process group that torchft reconfigures at every quorum."""
    quiet_torchft()
    collective = timedelta(milliseconds=ft.process_group_timeout_ms)
    pg = ProcessGroupNCCL(timeout=collective) if ft.process_group == "nccl" else ProcessGroupGloo(timeout=collective)
    return DtrainManager(
        lighthouse=lighthouse,
        first_timeout=timedelta(seconds=comm.init_timeout_seconds),
        later_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
        after_quorum=after_quorum,
        pg=pg,
        min_replica_size=ft.min_replica_size,
        use_async_quorum=False,  # the recovered state is loaded before the forward (DiLoCo requires it too)
        # The commit vote and the transfer of a whole state to a recovering group: the longer of the collectives'
        # timeout and the training collectives' (comm.train_timeout_seconds).
        timeout=max(collective, timedelta(seconds=comm.train_timeout_seconds)),
        connect_timeout=timedelta(seconds=comm.init_timeout_seconds),
        replica_id=f"dtrain_replica_{ft.replica_id}",
        init_sync=False,  # every group initializes the same weights from debug.seed
        **manager_args,
    )


def quiet_torchft() -> None:
    """torchft's servers log every quorum and commit at INFO (Rust), and its Manager logs a traceback for every
    collective a lost group broke: dtrain says each event in one line (which group, which step, how long), so
    torchft's own log is kept for DTRAIN_TRACEBACK=1 (its errors) or RUST_LOG (its servers)."""
    logging.getLogger("torchft").setLevel(logging.ERROR if os.environ.get("DTRAIN_TRACEBACK") else logging.CRITICAL)
    # A recovering group reads the peer's state from a received buffer that torch wraps without copying.
    warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
