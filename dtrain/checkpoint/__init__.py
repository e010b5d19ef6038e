"""Checkpoints with torch Distributed Checkpoint: atomic saves, the start-up rule, resharding, HF interop, preemption.

See docs/checkpointing.md for the folder layout and the start-up rule.
"""

from dtrain.checkpoint.config_checks import EXCLUDABLE_PARTS, check_checkpoint_config
from dtrain.checkpoint.folders import COMMIT_FILE, CommitRecord, scan_checkpoints
from dtrain.checkpoint.manager import CheckpointManager
from dtrain.checkpoint.preemption import PREEMPTION_SIGNALS, PreemptionWatcher
from dtrain.checkpoint.restore import Startup

__all__ = [
    "COMMIT_FILE",
    "EXCLUDABLE_PARTS",
    "PREEMPTION_SIGNALS",
    "CheckpointManager",
    "CommitRecord",
    "PreemptionWatcher",
    "Startup",
    "check_checkpoint_config",
    "scan_checkpoints",
]
