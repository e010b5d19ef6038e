"""Reading and writing state through torch Distributed Checkpoint (DCP): whole TrainState, weights only, async.

DCP stores every tensor with its global shape and each rank's pieces, so a checkpoint saved under one layout
(world size, FSDP/TP degrees) loads under another: each rank reads the byte ranges its own shards need.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from dtrain.checkpoint.checksums import (
    ChecksummingWriter,
    ChecksumMismatch,
    VerifyingReader,
)
from dtrain.checkpoint.folders import COMMIT_FILE, read_record
from dtrain.checkpoint.safe_reading import (
    SafeLoadPlanner,
    SafeWholeStateLoadPlanner,
    UnsafeCheckpoint,
    read_metadata_file,
)
from dtrain.errors import DtrainError
from dtrain.parallelize.torch_compat import ASYNC_STAGER_IS_REUSABLE
from dtrain.precision.mx import allow_mx_tensors_in_checkpoints
from dtrain.step.torchao_import import quiet_torchao_import

# Full checkpoints nest the weights under this key (TrainState.state_dict); model-only ones keep them at the top,
# as torchtitan's model-only checkpoints do, so either project can start from the other's weights.
MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# DCP warns on every save and load without a process group that it assumes one process: that is our intent. (A
# filter, not catch_warnings, because async saves warn from their background thread.)
warnings.filterwarnings("ignore", message="torch.distributed is .*single process", category=UserWarning)


def model_state_dict(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The weights of every model part by FQN (DTensors where the model is sharded): live references, not copies."""
    return {k: v for part in model_parts for k, v in get_model_state_dict(part).items()}


def set_model_weights(model_parts: list[nn.Module], weights: dict[str, torch.Tensor]) -> None:
    # Each part takes its own keys of the merged dict (pipeline stages), hence strict=False; the caller has
    # checked beforehand that every key is present.
    for part in model_parts:
        set_model_state_dict(part, weights, options=StateDictOptions(strict=False))


def export_weights(model_parts: list[nn.Module], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights, cast to `dtype` (a cast copies; float32 stays a reference), flat by FQN."""
    return {k: v.to(dtype) for k, v in model_state_dict(model_parts).items()}


def read_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{key: global shape} of every tensor stored in the DCP checkpoint at `path`."""
    metadata = read_metadata(path).state_dict_metadata
    return {k: tuple(m.size) for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}


def weights_prefix(shapes: dict[str, tuple[int, ...]]) -> str:
    """Where a checkpoint keeps its weights: under "model." (a full dtrain checkpoint) or at the top."""
    return f"{MODEL_KEY}." if any(k.startswith(f"{MODEL_KEY}.") for k in shapes) else ""


def read_full_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every weight of the DCP checkpoint at `path` as a whole tensor, by FQN (in one process, also when others
    exist: conversions, and rank 0 writing a Hugging Face export)."""
    metadata = read_metadata(path).state_dict_metadata
    shapes = {k: tuple(m.size) for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
    prefix = weights_prefix(shapes)
    wanted = {
        key: torch.empty(shape, dtype=metadata[key].properties.dtype)
        for key, shape in shapes.items()
        if key.startswith(prefix)
    }
    load(wanted, path, one_process=True)
    return {key[len(prefix):]: tensor for key, tensor in wanted.items()}


def read_whole_state(path: Path) -> dict[str, Any]:
    """The whole checkpoint at `path` as one nested dict of full tensors and values (one process; conversions)."""
    # What torch's dcp_to_torch_save does (with the private loader it uses: dcp.load would fill a copy of the
    # empty dict), but through the safe reader and planner: torch's would run the checkpoint's pickles.
    # A low-bit optimizer's moments are stored as torchao's tensor subclasses, which torch.load(weights_only=True)
    # admits once torchao.optim has registered them; they are read into plain (dequantized) tensors here.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    with quiet_torchao_import():
        import torchao.optim  # noqa: F401

    allow_mx_tensors_in_checkpoints()
    reader = verifying_reader(path)
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=reader, planner=SafeWholeStateLoadPlanner(), no_dist=True)
    except CheckpointException as err:
        _raise_refusal(err)
        raise
    return state


def check_weights_fit(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    prefix: str,
    weights: dict,
    stored_name: Callable[[str], str] | None = None,
) -> None:
    """Refuse, naming the first problem, a checkpoint whose weights are not this model's (missing or reshaped).

    `stored_name` gives the checkpoint's name for one of our FQNs where it spells them otherwise.
    """
    name = stored_name or (lambda key: key)
    missing = [k for k in weights if prefix + name(k) not in shapes]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise DtrainError(
            f"checkpoint {path} does not hold weight {name(missing[0])}{more} of this model "
            "(a different model.name/flavor, or not a model checkpoint)"
        )
    for key, tensor in weights.items():
        stored = shapes[prefix + name(key)]
        if stored != tuple(tensor.shape):
            raise DtrainError(
                f"checkpoint {path} holds {name(key)} with shape {list(stored)}, this model's is "
                f"{list(tensor.shape)} (model.flavor or model.args, vocabulary or tie_word_embeddings differ)"
            )


def place_like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`full`, a whole tensor that every rank holds, laid out as `target` (this rank's shards of a DTensor)."""
    full = full.to(dtype=target.dtype)
    if isinstance(target, DTensor):
        # Every rank holds the whole tensor, so each cuts its own shards without communication.
        return distribute_tensor(
            full.to(target.device_mesh.device_type), target.device_mesh, target.placements, src_data_rank=None
        )
    return full.to(target.device)


def first_failure(err: BaseException) -> tuple[int | None, BaseException]:
    """(rank, exception) of the first failure inside an exception out of DCP, which wraps each rank's failure
    (paired with its traceback) in one object; (None, err) for any other exception."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, cause = next(iter(failures.items()))
        cause = cause[0] if isinstance(cause, tuple) else cause
        return rank, cause if isinstance(cause, BaseException) else err
    return None, err


def failure_summary(err: BaseException) -> str:
    """One line for an exception out of DCP (see first_failure)."""
    rank, err = first_failure(err)
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0] if text else ''}"
    return line if rank is None else f"rank {rank}: {line}"


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of the checkpoint at `path`, read without running code from it (safe_reading.py)."""
    return read_metadata_file(path / ".metadata")


def verifying_reader(path: Path) -> VerifyingReader:
    """The reader for the checkpoint at `path`: its metadata read safely first (so that a refused file surfaces as
    itself, not inside DCP's collective error), its items checked against its commit record's checksums where it
    has a record (DamagedCheckpoint if the record no longer matches the files or lacks checksums); a checkpoint
    without one (from elsewhere) is read unverified."""
    read_metadata(path)
    checksums = read_record(path).checksums if (path / COMMIT_FILE).is_file() else None
    return VerifyingReader(str(path), checksums)


def _raise_refusal(err: CheckpointException) -> None:
    """Re-raise a refusal of ours (unsafe pickle, damaged bytes) from inside DCP's per-rank wrapping as itself."""
    refused = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
    ours = next((f for f in refused if isinstance(f, (UnsafeCheckpoint, ChecksumMismatch))), None)
    if ours is not None:
        raise ours from None


def load(
    state_dict: dict[str, Any], path: Path, process_group: dist.ProcessGroup | None = None, one_process: bool = False
) -> None:
    """Fill `state_dict` in place from the checkpoint at `path` (tensors are copied into, other values replaced);
    every rank takes part, unless `one_process` (then this process alone reads, without collectives).

    Nothing in the checkpoint runs as code (UnsafeCheckpoint), and every item read is checked against the
    checksum committed with it (ChecksumMismatch); both are one line.
    """
    allow_mx_tensors_in_checkpoints()
    reader = verifying_reader(path)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group,
                 no_dist=one_process or _single_process())
    except CheckpointException as err:
        _raise_refusal(err)
        raise


def save(state_dict: dict[str, Any], path: Path, process_group: dist.ProcessGroup | None = None) -> None:
    """Write `state_dict` to `path`, with a checksum of every item (checksums.py)."""
    dcp.save(state_dict, storage_writer=ChecksummingWriter(str(path)), process_group=process_group,
             no_dist=_single_process())


class AsyncSaver:
    """Async saves: a background thread copies ("stages") the state into host buffers, then writes it while
    training goes on.

    Forward and backward only read the weights and optimizer state; the optimizer step is the first thing that
    changes them. So the copy may run during the next step's forward and backward, and the caller must wait for
    `staging` to complete before the optimizer steps (CheckpointManager does, with an optimizer pre-hook).
    The host buffers are kept from one save to the next (pinned ones are slow to allocate) where torch's stager
    allows it (torch_compat.ASYNC_STAGER_IS_REUSABLE), which is safe because a save starts only after the
    previous one was written. Background saves talk over their own gloo process group, so they never interleave
    with the training's collectives.
    """

    def __init__(self, pinned_memory: bool, process_group: dist.ProcessGroup | None):
        from torch.distributed.checkpoint.staging import StagingOptions

        self._process_group = process_group
        self._options = StagingOptions(
            use_pinned_memory=pinned_memory,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=pinned_memory,
        )
        self._stager = None

    def start(self, state_dict: dict[str, Any], path: Path) -> tuple[Future | None, Future]:
        """Start staging `state_dict` and writing it to `path`: (staging done, written) futures."""
        from torch.distributed.checkpoint.staging import DefaultStager

        if self._stager is None or not ASYNC_STAGER_IS_REUSABLE:
            self.close()
            self._stager = DefaultStager(self._options)
        response = dcp.async_save(
            state_dict,
            storage_writer=ChecksummingWriter(str(path)),
            process_group=self._process_group,
            async_stager=self._stager,
            no_dist=_single_process(),
        )
        staging = getattr(response, "staging_completion", None)
        return staging, getattr(response, "upload_completion", response)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None
