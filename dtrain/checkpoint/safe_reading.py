"""Reading DCP checkpoints without running code from them.

DCP's FileSystemReader unpickles `.metadata` with plain `pickle.load`, and its DefaultLoadPlanner reads every
non-tensor value with `torch.load(weights_only=False)`: a hostile checkpoint (a downloaded initial_load_path, a
shared run folder) executes whatever its pickles name, on every rank, before any check of ours. Tensor data is
already read with `torch.load(weights_only=True)`. These two replacements close the rest, and every dtrain read
of a DCP checkpoint (resume, initial load, conversion, the commit check) goes through them:

- `SafeFileSystemReader` unpickles the metadata with an unpickler that admits only what DCP metadata is made of
  (its own dataclasses, torch.Size, dtypes, layouts, paths) and refuses anything else in one line;
- `SafeLoadPlanner` reads the non-tensor values (learning rates, steps, data-loader positions) with
  `torch.load(weights_only=True)`, which admits plain containers, numbers and strings.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from dtrain.errors import DtrainError

_PATH_CLASSES = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}


class UnsafeCheckpoint(DtrainError):
    """A checkpoint file asks to construct something a checkpoint never holds: refused before it runs."""


def _admitted(module: str, name: str) -> Any | None:
    """The object a metadata pickle may name as `module.name`, or None if it may not."""
    if module == dcp_metadata.__name__:
        value = getattr(dcp_metadata, name, None)
        # DCP's metadata dataclasses and enums; the module's functions and imports stay out.
        return value if isinstance(value, type) and value.__module__ == module else None
    if module == dcp_filesystem.__name__ and name == "_StorageInfo":
        return dcp_filesystem._StorageInfo
    if module == "torch":
        value = getattr(torch, name, None)
        return value if value is torch.Size or isinstance(value, (torch.dtype, torch.layout)) else None
    if module == "torch.serialization" and name == "_get_layout":
        return torch.serialization._get_layout  # looks a layout up by name in a table; nothing else
    if module == "pathlib" and name in _PATH_CLASSES:
        return getattr(pathlib, name)
    if module == "collections" and name == "OrderedDict":
        from collections import OrderedDict

        return OrderedDict
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        admitted = _admitted(module, name)
        if admitted is None:
            raise UnsafeCheckpoint(
                f"{self.source} asks for {module}.{name}, which DCP metadata never holds; refusing to read it "
                "(a damaged, foreign or hostile checkpoint)"
            )
        return admitted


def read_metadata_file(path: pathlib.Path) -> Metadata:
    """The DCP metadata in the file `path`, unpickled with only DCP's own metadata classes admitted."""
    with open(path, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file, str(path)).load()
        except UnsafeCheckpoint:
            raise
        except Exception as err:  # a torn or foreign file raises any of pickle's many error types
            raise DtrainError(f"{path} is not readable DCP metadata ({type(err).__name__}: {err})") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata; refusing to read it")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata comes from `read_metadata_file` (see the module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata_file(pathlib.Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint(
                f"checkpoint value {read_item.dest_index.fqn} is not plain data (damaged, or a pickle that names "
                "code); refusing to read it"
            ) from None
        super().load_bytes(read_item, _saved(loaded))


class SafeWholeStateLoadPlanner(SafeLoadPlanner, _EmptyStateDictLoadPlanner):
    """Loads a whole checkpoint into an empty dict, as torch's dcp_to_torch_save does (with its private
    _EmptyStateDictLoadPlanner), with the non-tensor values read as SafeLoadPlanner reads them."""


def _saved(value: Any) -> io.BytesIO:
    """`value` serialised again for DefaultLoadPlanner.load_bytes, which then places it: a checked value's
    round trip through torch.save, so that where it lands stays DCP's own logic."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer
