"""Text generation from a checkpoint on one device: `python -m dtrain.generate` (run_generate.sh calls it).

    ./run_generate.sh --checkpoint outputs/debug/checkpoint/step-10 --prompt "Once upon" --max_new_tokens 20
    ./run_generate.sh --checkpoint /models/Qwen3-0.6B --hf --prompt_ids 1,2,3 --max_new_tokens 8 --temperature 0.7
    ./run_generate.sh --checkpoint outputs/chat_lora --chat --system "Be brief."   (turns from stdin, see --chat)

A dtrain (DCP) checkpoint is read with its run's resolved config (`<run>/config.toml`, two folders above the
checkpoint, or `--config`), so it rebuilds the model it was trained as; `--model.*` flags (e.g.
`--model.hf_assets_path` for the tokenizer) apply on top; model args or LoRA settings that differ from what the
checkpoint's commit record says it was trained with are refused. A run folder, or its checkpoint folder, stands for
its newest committed checkpoint; an uncommitted `step-N.partial` is refused. With `--hf` the checkpoint is a Hugging
Face folder whose config.json decides family and shape, and whose tokenizer (if it has one) decodes the output.
stdout gets `ids: a,b,c` (the new token ids) and, when a tokenizer is known, `text: ...`; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain.errors import ConfigError, DtrainError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The generation options, and the remaining (config) flags."""
    parser = argparse.ArgumentParser(
        prog="run_generate.sh", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", type=Path, required=True, help="DCP checkpoint (or a run folder or its "
                        "checkpoint folder: the newest committed step), or with --hf a Hugging Face model folder")
    parser.add_argument("--hf", action="store_true", help="the checkpoint is a Hugging Face folder")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="text, encoded by the tokenizer after its BOS token")
    prompt.add_argument("--prompt_ids", help="comma-separated token ids, used as given")
    parser.add_argument("--chat", action="store_true", help="a conversation in the run's chat template: each stdin "
                        "line a user turn, the answer streamed to stdout and kept in the conversation (EOF ends)")
    parser.add_argument("--system", help="with --chat: the system prompt")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default); else finite, "
                        ">= 1.18e-38")
    parser.add_argument("--top_k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top_p", type=float, default=1.0, help="sample from the smallest set with this mass")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--ignore_eos", action="store_true", help="generate max_new_tokens even past EOS")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="weights and compute (default: bfloat16 on "
                        "GPU, float32 on CPU)")
    return parser.parse_known_args(argv)


@dataclass
class Loaded:
    """A model ready to generate, with what reads and ends its text."""

    model: nn.Module
    family: str
    tokenizer: Any
    eos_ids: tuple[int, ...]
    vocab_size: int
    max_seq_len: int
    config: Any  # the run's (or, with --hf, the flags') resolved config: its training.chat names the chat template


def _config_argv(opts: argparse.Namespace, rest: list[str], checkpoint: Path) -> list[str]:
    if opts.hf or _given_config(rest) is not None:
        return rest
    run_config = checkpoint.resolve().parent.parent / "config.toml"
    if not run_config.is_file():
        raise ConfigError(f"{run_config} not found (the run's config beside {checkpoint}); pass --config")
    return ["--config", str(run_config), *rest]


def _given_config(argv: list[str]) -> str | None:
    """The --config value among the config flags, if any."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.removeprefix("--config=")
    return None


def resolve_checkpoint(path: Path, hf: bool) -> Path:
    """The checkpoint `path` names: itself; for a run's checkpoint folder its newest committed step; for a run
    folder (the one with config.toml) its checkpoint folder's newest committed step. A `step-N.partial` (or
    `.replaced`) folder is refused: the commit protocol (dtrain/checkpoint/folders.py) never loads one."""
    from dtrain.checkpoint.folders import is_dcp_checkpoint, scan_checkpoints
    from dtrain.checkpoint.tool_checks import refuse_uncommitted

    if not path.exists():
        raise ConfigError(f"--checkpoint {path} does not exist")
    refuse_uncommitted(path, "--checkpoint")
    if hf or is_dcp_checkpoint(path):
        return path
    folder = path
    if (path / "config.toml").is_file():  # a run folder: its checkpoints are in its checkpoint.folder
        folder = path / _checkpoint_folder(path / "config.toml")
    scan = scan_checkpoints(folder)
    if not scan.committed:
        leftovers = f" (only uncommitted {scan.describe_incomplete()})" if scan.incomplete else ""
        raise ConfigError(
            f"--checkpoint {path} is neither a DCP checkpoint nor a run folder or checkpoint folder with committed "
            f"ones{leftovers} (add --hf for a Hugging Face folder)"
        )
    return scan.committed[-1].path


def _checkpoint_folder(run_config: Path) -> str:
    """checkpoint.folder as the run's resolved config.toml gives it (the schema's default where it is unset)."""
    from dtrain.config.schema import Checkpoint
    from dtrain.config.toml_io import read_toml

    return str(read_toml(run_config).get("checkpoint", {}).get("folder", Checkpoint().folder))


def _hf_eos_ids(folder: Path) -> tuple[int, ...]:
    """EOS ids as transformers' generate reads them: generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        file = folder / name
        if file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            if value is not None:
                return tuple(value) if isinstance(value, list) else (int(value),)
    return ()


def load_model(opts: argparse.Namespace, rest: list[str], device: torch.device, dtype: torch.dtype) -> Loaded:
    from dtrain.checkpoint.config_checks import model_record
    from dtrain.checkpoint.hf_io import token_ids
    from dtrain.checkpoint.tool_checks import check_config_agrees, read_checkpoint_record
    from dtrain.config import load_config
    from dtrain.data import build_tokenizer
    from dtrain.run.hf_start import hf_start
    from dtrain.run.prepare import model_args, model_family

    checkpoint = resolve_checkpoint(opts.checkpoint, opts.hf)
    argv = _config_argv(opts, rest, checkpoint)
    cfg = load_config(argv)
    record = None
    if opts.hf:
        cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_in_hf = str(checkpoint), True
        start = hf_start(cfg.checkpoint, cfg.model.name)
        if start is None:
            raise ConfigError(f"--hf: {checkpoint} has no config.json (a Hugging Face model folder has one)")
        family = start.family
        if not cfg.model.hf_assets_path and any((checkpoint / f).is_file() for f in HF_TOKENIZER_FILES):
            cfg.model.hf_assets_path, cfg.model.tokenizer = str(checkpoint), "auto"
        tokenizer = build_tokenizer(cfg.model) if cfg.model.hf_assets_path else None
        args = model_args(cfg, family.model, tokenizer.vocab_size if tokenizer else 0, start)
        eos_ids = _hf_eos_ids(checkpoint)
    else:
        family, start = model_family(cfg)  # as training resolves it: the run's config may name no flavor
        tokenizer = build_tokenizer(cfg.model)
        args = model_args(cfg, family.model, tokenizer.vocab_size, start)
        # The model and LoRA settings the checkpoint was trained with, not another config's (tool_checks.py).
        record = read_checkpoint_record(checkpoint, "--checkpoint")
        given = _given_config(rest)
        source = f"--config {given}" if given else f"the run's config {_given_config(argv)}"
        check_config_agrees(checkpoint, record, source, model_record(cfg.model, args), cfg.lora)
        # Those its Hugging Face export carries (to-hf), so that both stop at the same token.
        eos = token_ids(cfg.model, cfg.checkpoint)["eos_token_id"]
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    with torch.device("meta"):
        model = family.model.model_cls(args)
    model = model.to_empty(device=device).to(dtype)
    model.init_buffers(device)
    if opts.hf:
        from dtrain.checkpoint.hf_io import load_hf_weights

        load_hf_weights([model], checkpoint, family.model.hf_adapter(args))
    elif record is not None and record.lora:
        _load_lora_run_weights(model, checkpoint, cfg.lora, family.model.hf_adapter(args))
    else:
        _load_dcp_weights(model, checkpoint)
    eos_ids = () if opts.ignore_eos else eos_ids
    return Loaded(model.eval(), family.name, tokenizer, eos_ids, args.vocab_size, args.max_seq_len, cfg)


def _load_dcp_weights(model: nn.Module, path: Path) -> None:
    """The model's weights from a full or model-only DCP checkpoint, read straight into its tensors."""
    from dtrain.checkpoint import dcp_io

    weights = dcp_io.model_state_dict([model])
    shapes = dcp_io.read_tensor_shapes(path)
    prefix = dcp_io.weights_prefix(shapes)
    dcp_io.check_weights_fit(path, shapes, prefix, weights)
    try:
        dcp_io.load({prefix + k: v for k, v in weights.items()}, path)
    except Exception as err:  # DCP wraps the reader's failure; one line of it is what the user needs
        raise DtrainError(f"cannot read checkpoint {path} ({dcp_io.failure_summary(err)})") from err


def _load_lora_run_weights(model: nn.Module, path: Path, lora, hf_adapter) -> None:
    """A LoRA run's model with its adapters merged into the base weights (W + scaling * B @ A): the plain model
    computes what the run's did. An adapter-only checkpoint's frozen base comes from the base it refers to."""
    from dtrain.checkpoint.peft_export import lora_run_weights, merged_weights

    base_fqns = list(model.state_dict())
    model.load_state_dict(merged_weights(lora_run_weights(path, hf_adapter, base_fqns), lora), strict=True)


def prompt_ids(opts: argparse.Namespace, loaded: Loaded) -> list[int]:
    if opts.prompt is not None:
        if loaded.tokenizer is None:
            raise ConfigError(
                f"--prompt needs a tokenizer and {opts.checkpoint} has none; pass --prompt_ids, or "
                "--model.hf_assets_path with a tokenizer folder"
            )
        return [loaded.tokenizer.bos_id, *loaded.tokenizer.encode(opts.prompt)]
    try:
        ids = [int(part) for part in opts.prompt_ids.split(",")]
    except ValueError:
        raise ConfigError(f"--prompt_ids {opts.prompt_ids!r} is not a comma-separated list of integers") from None
    vocab = loaded.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"--prompt_ids has {bad[0]}, outside this model's vocabulary 0..{vocab - 1}")
    return ids


def _device_and_dtype(opts: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    name = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device (valid: cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here (use --device cpu)")
    dtype = DTYPES[opts.dtype] if opts.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype


def run(argv: list[str]) -> int:
    from dtrain.generate_chat import chat, check_prompt_options
    from dtrain.models.decoding import Sampling, generate

    opts, rest = parse_args(argv)
    check_prompt_options(opts)
    try:
        sampling = Sampling(opts.temperature, opts.top_k, opts.top_p)
    except ValueError as err:
        raise ConfigError(f"--{err}") from None
    if opts.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {opts.max_new_tokens}")
    device, dtype = _device_and_dtype(opts)
    loaded = load_model(opts, rest, device, dtype)
    if opts.chat:
        return chat(opts, loaded, sampling, device)
    ids = prompt_ids(opts, loaded)
    if len(ids) + opts.max_new_tokens - 1 > loaded.max_seq_len:
        raise ConfigError(
            f"prompt ({len(ids)} tokens) + --max_new_tokens {opts.max_new_tokens} exceed the model's max_seq_len "
            f"{loaded.max_seq_len} (raise it with --model.args.max_seq_len)"
        )
    generator = torch.Generator(device).manual_seed(opts.seed)
    began = time.perf_counter()
    prompt = torch.tensor([ids], device=device)
    # Only ids the tokenizer can decode: the padding rows of a vocabulary rounded up past it stay unchosen.
    tokenizer_vocab = loaded.tokenizer.vocab_size if loaded.tokenizer is not None else None
    new = generate(
        loaded.model, prompt, opts.max_new_tokens, sampling, loaded.eos_ids, generator, tokenizer_vocab
    )[0].tolist()
    seconds = time.perf_counter() - began
    print(f"generate: {loaded.family} on {device} ({str(dtype).removeprefix('torch.')}), {len(ids)} prompt tokens, "
          f"{len(new)} new in {seconds:.2f} s ({len(new) / seconds:.1f} tokens/s)", file=sys.stderr)
    print("ids: " + ",".join(str(i) for i in new))
    if loaded.tokenizer is not None:
        print("text: " + loaded.tokenizer.decode(new))
    return 0


def main(argv: list[str] | None = None, run=run) -> int:
    """`run(argv)` (this tool's, or another tool's built on it: dtrain/eval/cli.py) with a DtrainError as one
    `error:` line and its exit code (DTRAIN_TRACEBACK=1: the traceback instead)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except DtrainError as err:
        if os.environ.get("DTRAIN_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
