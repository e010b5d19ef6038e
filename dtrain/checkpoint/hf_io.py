"""Hugging Face safetensors in and out, for any model family (each family's ModelFamily has its HF adapter).

Reading goes through `safetensors` only (no pickle): tensors are memory-mapped and read one at a time, so a rank
holds at most one full tensor beyond its own shards while loading. Writing (for the conversion script) splits the
weights into files of at most `max_shard_bytes` with HF's `model.safetensors.index.json`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dtrain.checkpoint.dcp_io import model_state_dict, place_like, set_model_weights
from dtrain.checkpoint.export_folder import export_mark
from dtrain.checkpoint.load_checks import first_non_finite
from dtrain.checkpoint.peft_names import is_lora
from dtrain.checkpoint.spellings import model_fqns
from dtrain.errors import DtrainError
from dtrain.models.decoder import DecoderArgs
from dtrain.parallelize import get_family

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# The special-token ids of a config.json; transformers' generate stops at eos_token_id, and without these keys some
# configs default to ids of their own (DeepseekV3Config's bos 0, eos 1).
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id")


def build_adapter(family: str, model_args: DecoderArgs):
    """The Hugging Face adapter of the family registered as `family`, for models of `model_args`."""
    return get_family(family).model.hf_adapter(model_args)


def safetensors_index(path: Path) -> dict[str, Path]:
    """{HF tensor name: file} for a folder of safetensors (with or without an index) or a single .safetensors file."""
    from safetensors import safe_open

    if path.is_file():
        files = [path] if path.suffix == ".safetensors" else []
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DtrainError(f"{path} holds no .safetensors files (expected a Hugging Face model folder)")
    index: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                index.update({name: file for name in handle.keys()})
        except Exception as err:  # safetensors raises its own error types for torn or foreign files
            raise DtrainError(f"{file} is not a readable safetensors file ({err})") from err
    return index


def read_hf_config(path: Path) -> dict[str, Any] | None:
    folder = path if path.is_dir() else path.parent
    file = folder / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except ValueError as err:
        raise DtrainError(f"{file} is not valid JSON ({err})") from err


def token_ids(model_cfg, checkpoint_cfg) -> dict[str, Any]:
    """The special-token ids a config.json written for a run carries: those of the Hugging Face config.json it
    started from (an eos list included), the tokenizer's for any it lacks (`model_cfg`, `checkpoint_cfg`: the
    run's sections)."""
    from dtrain.data import build_tokenizer

    ids: dict[str, Any] = {}
    if checkpoint_cfg.initial_load_in_hf and checkpoint_cfg.initial_load_path:
        original = read_hf_config(Path(checkpoint_cfg.initial_load_path)) or {}
        ids = {key: original[key] for key in TOKEN_ID_KEYS if original.get(key) is not None}
    if len(ids) < len(TOKEN_ID_KEYS):
        tokenizer = build_tokenizer(model_cfg)
        ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, **ids}
    return ids


@contextlib.contextmanager
def _open_all(files: set[Path]) -> Iterator[dict[Path, Any]]:
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        yield {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in files}


def iter_hf_weights(path: Path, adapter, fqns: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(our FQN, full tensor in our layout) for each of `fqns`, read from the HF checkpoint at `path` (from one HF
    tensor, or from several that the adapter stacks: a MoE layer's experts)."""
    index = safetensors_index(path)
    names = {fqn: adapter.hf_names(fqn) for fqn in fqns}
    missing = [(fqn, name) for fqn in fqns for name in names[fqn] if name not in index]
    if missing:
        raise DtrainError(
            f"Hugging Face checkpoint {path} lacks {missing[0][1]} (for {missing[0][0]})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    with _open_all({index[name] for fqn in fqns for name in names[fqn]}) as handles:
        for fqn in fqns:
            yield fqn, adapter.from_hf(fqn, *(handles[index[name]].get_tensor(name) for name in names[fqn]))


def load_hf_weights(model_parts: list[nn.Module], path: Path, adapter, group: dist.ProcessGroup | None = None) -> None:
    """Load HF safetensors weights into the (possibly sharded) model parts; every weight but LoRA adapters must be
    found, and finite (`group`: all ranks, which agree on the first that is not)."""
    config = read_hf_config(path)
    if config is not None:
        try:
            adapter.check_hf_config(config)
        except ValueError as err:
            raise DtrainError(f"Hugging Face config {path}/{CONFIG_FILE} {err}") from None
    # A Hugging Face model folder holds a LoRA model's frozen base; its adapters come from elsewhere (their init, a
    # PEFT adapter, a checkpoint).
    targets = {fqn: t for fqn, t in model_state_dict(model_parts).items() if not is_lora(fqn)}
    loaded: dict[str, torch.Tensor] = {}
    for fqn, full in iter_hf_weights(path, adapter, list(targets)):
        target = targets[fqn]
        if tuple(full.shape) != tuple(target.shape):
            names = adapter.hf_names(fqn)
            source = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} (stacked)"
            raise DtrainError(
                f"Hugging Face checkpoint {path}: {source} has shape {list(full.shape)}, "
                f"this model's {fqn} has {list(target.shape)}"
            )
        loaded[fqn] = place_like(full, target)
    bad = first_non_finite(loaded, model_fqns(loaded, group), group)
    if bad is not None:
        name = adapter.hf_names(bad)[0]
        raise DtrainError(f"Hugging Face checkpoint {safetensors_index(path)[name]}: {name} holds NaN or Inf values; "
                          "a checkpoint to start from must be finite (was it saved from a diverged run, or damaged?)")
    set_model_weights(model_parts, loaded)


def save_hf(
    weights: dict[str, torch.Tensor], out_dir: Path, adapter, dtype: torch.dtype, max_shard_bytes: int = 5 << 30,
    special_tokens: dict[str, Any] | None = None,
) -> list[Path]:
    """Write full (unsharded) weights as HF safetensors plus config.json (with `special_tokens`, e.g. `token_ids`)
    into `out_dir`; returns the files written."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for fqn, tensor in weights.items():
        for name, hf_tensor in adapter.to_hf_tensors(fqn, tensor):
            hf_tensor = hf_tensor.to(dtype).contiguous()
            size = hf_tensor.numel() * hf_tensor.element_size()
            if shards[-1] and shard_bytes + size > max_shard_bytes:
                shards.append({})
                shard_bytes = 0
            shards[-1][name] = hf_tensor
            shard_bytes += size
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = []
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata=export_mark("hf"))
        written.append(out_dir / name)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        weight_map = {tensor: name for name, shard in zip(names, shards) for tensor in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        written.append(out_dir / INDEX_FILE)
    config = {**adapter.hf_config(dtype), **(special_tokens or {})}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    written.append(out_dir / CONFIG_FILE)
    return written
