"""What saving and restoring both need to know about the run, and how ranks agree on a decision."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from dtrain.config.schema import Checkpoint, LoRA, Model, Optimizer, Parallelism, Training
from dtrain.errors import DtrainError
from dtrain.models.decoder import DecoderArgs
from dtrain.step.state import TrainState

T = TypeVar("T")
# Recorded with each checkpoint for the log and for humans; resharding itself needs none of it.
PARALLEL_DEGREES = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
)


@dataclass
class RunContext:
    """The run a CheckpointManager serves: the config sections it reads, its state and ranks. `group` is a gloo
    group of all ranks (None in a single process)."""

    checkpoint: Checkpoint
    training: Training  # steps, and what the saved data position means
    parallelism: Parallelism  # recorded with each checkpoint
    model: Model  # the family, for Hugging Face weights
    optimizer: Optimizer  # checked against a checkpoint's optimizer state
    folder: Path
    state: TrainState
    rank: int
    world_size: int
    group: dist.ProcessGroup | None
    model_args: DecoderArgs | None  # None: a state with no model family (tests, tools)
    lora: LoRA | None = None  # the [lora] section
    # The frozen base this LoRA run's checkpoints refer to instead of holding it (lora_base.py); set at start-up.
    base: dict[str, Any] | None = None

    def data_layout(self) -> dict[str, Any]:
        """What the saved data position means: resuming it is exact only if these are unchanged (dp_size aside).

        The loader's state counts global sequences of one global stream, so a new data-parallel size continues
        it exactly as long as the global batch (sequences per step), sequence length and dataset stay the same.
        """
        t = self.training
        dp_size = self.state.setup.rank.dp_size
        global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_size
        return {
            "global_batch": global_batch,
            "seq_len": t.seq_len,
            "dataset": t.dataset,
            "dataset_path": t.dataset_path,
            "dataset_mixture": t.dataset_mixture,
            "dataset_shuffle": t.dataset_shuffle,
            "dp_size": dp_size,
        }

    def parallel_degrees(self) -> dict[str, int]:
        return {name: getattr(self.parallelism, name) for name in PARALLEL_DEGREES}

    def agree(self, decide: Callable[[], T]) -> T:
        """Run `decide` on rank 0 only and return its result on every rank; its DtrainError is raised on all.

        Rank 0 alone reads the checkpoint folder, so every rank acts on the same snapshot of it, and a
        problem found there stops all ranks with the same one-line message instead of leaving them waiting.
        """
        if self.group is None:
            return decide()
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", decide())
            except DtrainError as err:
                box[0] = ("error", type(err), str(err))
            except Exception as err:
                box[0] = ("crash", RuntimeError, f"rank 0 failed while reading checkpoints: {err!r}")
                dist.broadcast_object_list(box, src=0, group=self.group)
                raise
        dist.broadcast_object_list(box, src=0, group=self.group)
        if box[0][0] != "ok":
            raise box[0][1](box[0][2])
        return box[0][1]
