"""Adapter-only checkpoints of a LoRA run: what they record of the frozen base, and the checks before loading one.

A LoRA run that started from checkpoint.initial_load_path never changes those weights, so its checkpoints (DCP,
full or model-only) hold only the adapters (and the optimizer state, which covers only them) plus a reference to the
base: its path, whether it is a Hugging Face folder, and a fingerprint (every file's size, and a digest of small
files whole and of both ends of large ones: every safetensors header, a DCP commit record with its checksum of every
item, the first and last values of each weight file). Loading such a checkpoint loads the base from the reference
first, then the adapters; a base that is gone or whose files changed is refused in one line. A LoRA run from scratch
has a random base, which its checkpoints then hold whole.

The record also keeps the [lora] settings the adapters were trained with: a resume that changes them is refused
(rank and targets change the adapters' shapes and names; alpha and rsLoRA their scale, silently).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

from dtrain.errors import DtrainError

SETTINGS = ("rank", "alpha", "use_rslora", "target_modules")
# Bytes read from each end of a large file for its fingerprint (after a safetensors file's header): a base of the
# same architecture with other values (another fine-tune) differs there; hashing a whole 16 GB base would take long.
SAMPLE_BYTES = 1 << 16
# The files of a base that hold or describe its weights (a tokenizer or README beside them may come and go).
WEIGHT_SUFFIXES = (".safetensors", ".distcp")
DESCRIBING_FILES = ("config.json", "model.safetensors.index.json", ".metadata", "dtrain_commit.json")


def _sampled_bytes(file: Path) -> bytes:
    """The bytes of `file` its fingerprint hashes: all of a small file; of a large one its head (a safetensors
    file's whole header, which names every tensor's dtype, shape and place, plus SAMPLE_BYTES) and last
    SAMPLE_BYTES."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = SAMPLE_BYTES
        if file.suffix == ".safetensors" and size >= 8:
            head += 8 + struct.unpack("<Q", handle.read(8))[0]
            handle.seek(0)
        if size <= head + SAMPLE_BYTES:
            return handle.read()
        first = handle.read(head)
        handle.seek(size - SAMPLE_BYTES)
        return first + handle.read()


def fingerprint(path: Path) -> dict[str, Any]:
    """{"sizes": {file: bytes}, "digest": sha256 of each file's sampled bytes} of the base at `path` (a folder, or
    one .safetensors file)."""
    files = [path] if path.is_file() else sorted(
        f for f in path.iterdir() if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name in DESCRIBING_FILES)
    )
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + _sampled_bytes(file))
    return {"sizes": {f.name: f.stat().st_size for f in files}, "digest": digest.hexdigest()}


def lora_record(lora, base: dict[str, Any] | None) -> dict[str, Any]:
    """What a LoRA run's checkpoints record: its [lora] settings and `base` (a `base_reference`, or None where the
    checkpoint holds the base itself); {} for a run without LoRA."""
    if lora is None or not lora.enable:
        return {}
    return {**{key: getattr(lora, key) for key in SETTINGS}, "base": base}


def base_reference(path: Path, in_hf: bool) -> dict[str, Any]:
    """The reference to the frozen base a run loaded from `path` (checkpoint.initial_load_path)."""
    return {"path": str(path.resolve()), "in_hf": in_hf, "fingerprint": fingerprint(path)}


def check_base_reference(checkpoint: Path, base: dict[str, Any]) -> Path:
    """The base's path, after refusing in one line a base that is gone or differs from the one the adapters of
    `checkpoint` were trained on."""
    path = Path(base["path"])
    told = f"checkpoint {checkpoint} holds LoRA adapters only; their frozen base weights were read from {path}"
    if not path.exists():
        raise DtrainError(f"{told}, which no longer exists: put that base model back at {path} to load it")
    now = fingerprint(path)
    saved = base["fingerprint"]
    for name in sorted({*saved["sizes"], *now["sizes"]}):
        old, new = saved["sizes"].get(name), now["sizes"].get(name)
        if old != new:
            change = "is gone" if new is None else "is new" if old is None else f"has {new} bytes, had {old}"
            raise DtrainError(f"{told}, which differs now ({name} {change}): put that base model back at {path}")
    if saved["digest"] != now["digest"]:
        raise DtrainError(f"{told}, which differs now (the contents of its files changed): put that "
                          f"base model back at {path}")
    return path


def check_lora_settings(checkpoint: Path, saved: dict[str, Any], lora) -> None:
    """Refuse a resume whose [lora] settings differ from those the checkpoint's adapters were trained with (or a
    LoRA checkpoint without LoRA, and the reverse)."""
    enabled = lora is not None and lora.enable
    if bool(saved) != enabled:
        had, keep = ("with", "true") if saved else ("without", "false")
        raise DtrainError(f"checkpoint {checkpoint} was trained {had} LoRA; set lora.enable = {keep} to resume it, "
                          "or start a new job.dump_folder")
    for key in SETTINGS if saved else ():
        if saved[key] != getattr(lora, key):
            raise DtrainError(f"lora.{key} = {getattr(lora, key)!r} differs from checkpoint {checkpoint}'s "
                              f"{saved[key]!r}: set lora.{key} = {saved[key]!r}, or start a new job.dump_folder")
