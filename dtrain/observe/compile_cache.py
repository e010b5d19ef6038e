"""torch's portable compile cache, kept with the run: a resumed run, or a new run of the same model and layout,
loads what an earlier one compiled instead of compiling it again.

``torch.compiler.save_cache_artifacts()`` serializes what the caches behind torch.compile recorded in this
process; ``load_cache_artifacts`` writes them back into this machine's caches before anything compiles, so
compiling becomes cache hits (dynamo still traces; AOT autograd and inductor are skipped). Files live under
``<compile.cache_dir or <dump_folder>/compile_cache>/<key>/`` (``rank<r>.bin``, ``rank<r>.json``, ``key.json``),
written atomically after the first step and again at the end if later steps compiled more. The key hashes only
what shapes the compiled graphs (``graph_settings``); torch's caches are content-addressed, so a key that is too
coarse costs disk, never correctness. Loading a cache runs the code in it, like loading a pickle.

What is saved, the key's contents and what a hit saves on CPU and CUDA: docs/profiling.md, "Compile caches".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from dtrain.config.schema import JobConfig
from dtrain.config.schema_observe import Compile
from dtrain.config.toml_io import config_to_dict

logger = logging.getLogger("dtrain")

DEFAULT_FOLDER = "compile_cache"
# Compile settings that only say where things are written: they change no graph.
_OUTPUT_ONLY_COMPILE_KEYS = ("cache", "cache_dir", "trace_folder", "debug_dir")
# Training settings that shape the graphs: batch and sequence shapes, dtypes, masks, offloading.
_GRAPH_TRAINING_KEYS = (
    "seq_len", "local_batch_size", "mixed_precision_param", "mixed_precision_reduce", "enable_cpu_offload",
    "attention_mask", "attention_mask_backend",
)


def graph_settings(cfg: JobConfig, world_size: int) -> dict:
    """The settings the compiled graphs depend on: torch and device, model, layout, AC, compile, precision and
    batch shapes (the key hashes these). It reads the resolved config as data, a few fields of many sections, so it
    takes the whole config."""
    document = config_to_dict(cfg)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "torch": torch.__version__,
        "device": device,
        "world_size": world_size,
        "model": document["model"],
        "parallelism": document["parallelism"],
        "activation_checkpoint": document["activation_checkpoint"],
        "compile": {k: v for k, v in document["compile"].items() if k not in _OUTPUT_ONLY_COMPILE_KEYS},
        "quantize": document["quantize"],
        "optimizer": {k: document["optimizer"][k] for k in ("name", "implementation")},
        "training": {k: document["training"][k] for k in _GRAPH_TRAINING_KEYS},
    }


def cache_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def cache_root(compile: Compile, dump_folder: str) -> Path:
    """compile.cache_dir (relative to job.dump_folder unless absolute), or the run folder's compile_cache."""
    return Path(dump_folder) / (compile.cache_dir or DEFAULT_FOLDER)


@dataclass
class PortableCompileCache:
    """This rank's compile cache file for this run's key: `load` before the first step, `save` after it."""

    folder: Path  # <root>/<key>
    rank: int
    settings: dict
    on_disk: frozenset = frozenset()  # (kind, key) of each artifact the file holds, as loaded or last saved
    loaded: dict | None = None  # what `load` put into the caches, for the compile report

    @classmethod
    def for_run(cls, settings: dict, compile: Compile, dump_folder: str, rank: int) -> PortableCompileCache:
        """This rank's cache for the graphs of `settings` (see `graph_settings`)."""
        return cls(cache_root(compile, dump_folder) / cache_key(settings), rank, settings)

    @property
    def data_file(self) -> Path:
        return self.folder / f"rank{self.rank}.bin"

    @property
    def record_file(self) -> Path:
        return self.folder / f"rank{self.rank}.json"

    def load(self) -> None:
        """Put this rank's saved artifacts into torch's caches, if there are any for this key; a damaged file is
        reported and skipped (the run then compiles as without a cache)."""
        if not self.data_file.exists():
            others = [p.name for p in self.folder.parent.glob("*/key.json")] if self.folder.parent.is_dir() else []
            logger.info(
                "compile cache: nothing saved for this model and layout in %s (%d other key(s) there); compiling "
                "afresh", self.folder.parent, len(others),
            )
            return
        data = self.data_file.read_bytes()
        problem = self._damage(data)
        if problem:
            logger.warning("compile cache: %s is %s; compiling afresh", self.data_file, problem)
            return
        info = torch.compiler.load_cache_artifacts(data)
        counts = _counts(info)
        self.on_disk = _keys(info)
        self.loaded = {"from": str(self.data_file), "artifacts": counts}
        logger.info("compile cache: loaded %s from %s", _describe(counts), self.data_file)

    def _damage(self, data: bytes) -> str | None:
        try:
            record = json.loads(self.record_file.read_text())
        except (OSError, ValueError) as err:
            return f"without a readable {self.record_file.name} ({err})"
        if record.get("bytes") != len(data) or record.get("xxh3_64") != xxhash.xxh3_64_hexdigest(data):
            return f"damaged (its size or checksum differs from {self.record_file.name})"
        return None

    def save(self, step: int) -> None:
        """Write what this process's compiles recorded (the artifacts it hit or made), unless the file on disk holds
        all of it already; atomically: a crash mid-write leaves the previous file. After a change of the model
        code the graphs differ under the same key: the file then follows the new graphs."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data, info = saved
        if _keys(info) <= self.on_disk:
            return
        counts = _counts(info)
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            _write_atomically(self.folder / "key.json", (json.dumps(self.settings, indent=1) + "\n").encode())
        record = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data), "artifacts": counts, "step": step}
        _write_atomically(self.data_file, data)
        _write_atomically(self.record_file, (json.dumps(record, indent=1) + "\n").encode())
        self.on_disk = _keys(info)
        logger.info("compile cache: saved %s (%.1f MB) to %s", _describe(counts), len(data) / 1e6, self.data_file)


def _keys(info) -> frozenset:
    return frozenset((kind, key) for kind, keys in info.artifacts.items() for key in keys)


def _counts(info) -> dict[str, int]:
    return {kind: len(keys) for kind, keys in info.artifacts.items() if keys}


def _describe(counts: dict[str, int]) -> str:
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
    return f"{sum(counts.values())} artifact(s) ({kinds})"


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + f".tmp{os.getpid()}")
    temporary.write_bytes(data)
    os.replace(temporary, path)
