"""Convert checkpoints between dtrain (DCP), Hugging Face safetensors and a single torch.save file. One process.

    # DCP (full or model-only, any layout it was saved with) -> HF LlamaForCausalLM folder (safetensors + config.json)
    python scripts/convert_checkpoint.py to-hf outputs/run/checkpoint/step-1000 hf_out --dtype bfloat16
    # HF folder -> DCP model-only checkpoint (use as checkpoint.initial_load_path); the family is config.json's
    python scripts/convert_checkpoint.py from-hf /models/Llama-3.1-8B dcp_out
    # DCP -> one file for plain torch: torch.load("model.pt", weights_only=True)
    python scripts/convert_checkpoint.py to-torch outputs/run/checkpoint/step-1000 model.pt

to-hf needs the model's hyperparameters: it reads the run's resolved config (<run>/config.toml, found two folders
above the checkpoint; or --config), which records them in full; the config.json it writes carries the special-token
ids of the HF config the run started from, else of its tokenizer. from-hf reads family and shape from the HF
config.json (--family overrides its architecture / model_type).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.folders import CommitRecord, commit
from dtrain.checkpoint.hf_io import CONFIG_FILE, build_adapter, iter_hf_weights, read_hf_config, save_hf, token_ids
from dtrain.errors import DtrainError
from dtrain.parallelize import FAMILIES, get_family
from dtrain.run.hf_start import family_of

DTYPES = dcp_io.EXPORT_DTYPES  # the dtypes of checkpoint.export_dtype


def run_config_args(checkpoint: Path, config: Path | None):
    """(family name, model args, the run's config) of the run that wrote `checkpoint`, from its resolved
    config.toml."""
    from dtrain.config import load_config
    from dtrain.data import build_tokenizer
    from dtrain.run.prepare import model_args, model_family

    config = config or checkpoint.resolve().parent.parent / "config.toml"
    if not config.is_file():
        raise DtrainError(f"{config} not found; pass --config with the run's config.toml")
    cfg = load_config(["--config", str(config)])
    family, start = model_family(cfg)  # as training resolves it: the config may name no flavor
    return family.name, model_args(cfg, family.model, build_tokenizer(cfg.model).vocab_size, start), cfg


def expected_shapes(family_name: str, args) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = get_family(family_name).model.model_cls(args)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def to_hf(opts) -> None:
    family, args, cfg = run_config_args(opts.checkpoint, opts.config)
    adapter = build_adapter(family, args)
    try:  # a model Hugging Face's class would compute differently is refused before anything is read or written
        adapter.hf_config(DTYPES[opts.dtype])
    except ValueError as err:
        raise DtrainError(f"cannot export {opts.checkpoint} to Hugging Face: {err}") from None
    weights = dcp_io.read_full_weights(opts.checkpoint)
    expected = expected_shapes(family, args)
    if {k: tuple(v.shape) for k, v in weights.items()} != expected:
        raise DtrainError(f"{opts.checkpoint} does not hold the weights of the model its config describes")
    files = save_hf(weights, opts.out, adapter, DTYPES[opts.dtype], int(opts.max_shard_gb * 2**30),
                    special_tokens=token_ids(cfg.model, cfg.checkpoint))
    print(f"wrote {len(files)} files to {opts.out}")


def from_hf(opts) -> None:
    config = read_hf_config(opts.hf_dir)
    if config is None:
        raise DtrainError(f"{opts.hf_dir} has no config.json (needed for the model's shape)")
    source = str((opts.hf_dir if opts.hf_dir.is_dir() else opts.hf_dir.parent) / CONFIG_FILE)
    family = get_family(opts.family) if opts.family else family_of(config, source)
    adapter_cls = family.model.hf_adapter
    try:
        args = adapter_cls.args_from_hf_config(config)
    except (KeyError, TypeError, ValueError) as err:
        raise DtrainError(f"{source} is not a readable {family.name} config ({type(err).__name__}: {err})") from None
    adapter = adapter_cls(args)
    names = list(expected_shapes(family.name, args))
    weights = {fqn: t.to(DTYPES[opts.dtype]) for fqn, t in iter_hf_weights(opts.hf_dir, adapter, names)}
    partial = opts.out.with_name(opts.out.name + ".partial")
    dcp_io.save(weights, partial)
    record = CommitRecord(
        step=0, kind="model_only", dtype=opts.dtype,
        saved_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch_version=torch.__version__, tie_word_embeddings=args.tie_word_embeddings,
    )
    commit(partial, opts.out, record)
    print(f"wrote a model-only DCP checkpoint ({len(weights)} tensors) to {opts.out}")


def to_torch(opts) -> None:
    torch.save(dcp_io.read_whole_state(opts.checkpoint), opts.out)
    print(f"wrote {opts.out}; read it with torch.load(path, weights_only=True)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    hf = commands.add_parser("to-hf", help="DCP checkpoint -> Hugging Face safetensors folder")
    hf.add_argument("checkpoint", type=Path)
    hf.add_argument("out", type=Path)
    hf.add_argument("--config", type=Path, default=None, help="the run's config.toml (default: <run>/config.toml)")
    hf.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    hf.add_argument("--max-shard-gb", type=float, default=5.0)
    back = commands.add_parser("from-hf", help="Hugging Face safetensors folder -> DCP model-only checkpoint")
    back.add_argument("hf_dir", type=Path)
    back.add_argument("out", type=Path)
    back.add_argument("--family", choices=sorted(FAMILIES), default=None,
                      help="model family (default: config.json's architectures / model_type)")
    back.add_argument("--dtype", choices=DTYPES, default="float32")
    plain = commands.add_parser("to-torch", help="DCP checkpoint -> one torch.save file")
    plain.add_argument("checkpoint", type=Path)
    plain.add_argument("out", type=Path)
    opts = parser.parse_args(argv)
    try:
        {"to-hf": to_hf, "from-hf": from_hf, "to-torch": to_torch}[opts.command](opts)
    except DtrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
