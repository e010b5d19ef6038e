"""Convert checkpoints between dtrain (DCP), Hugging Face safetensors and a single torch.save file. One process.

    # DCP (full or model-only, any layout it was saved with) -> HF LlamaForCausalLM folder (safetensors + config.json)
    python scripts/convert_checkpoint.py to-hf outputs/run/checkpoint/step-1000 hf_out --dtype bfloat16
    # HF folder -> DCP model-only checkpoint (use as checkpoint.initial_load_path); the family is config.json's
    python scripts/convert_checkpoint.py from-hf /models/Llama-3.1-8B dcp_out
    # DCP -> one file for plain torch: torch.load("model.pt", weights_only=True)
    python scripts/convert_checkpoint.py to-torch outputs/run/checkpoint/step-1000 model.pt
    # a LoRA run's DCP checkpoint -> PEFT adapter folder (adapter_config.json + adapter_model.safetensors); with no
    # folder given, exports go beside the run's checkpoints: outputs/run/exports/peft-step-1000
    python scripts/convert_checkpoint.py to-peft outputs/run/checkpoint/step-1000

to-hf needs the model's hyperparameters: it reads the run's resolved config (<run>/config.toml, found two folders
above the checkpoint; or --config), which records them in full; a config whose model args or [lora] settings differ
from what the checkpoint's commit record says it was trained with is refused. The config.json it writes carries the
special-token ids of the HF config the run started from, else of its tokenizer. from-hf reads family and shape from
the HF config.json (--family overrides its architecture / model_type). A LoRA run's checkpoint (lora.enable in its
config) goes to-hf with every adapter merged into its base weight, its frozen base read from where the run read it
(an adapter-only checkpoint refers to it), and to-peft as the adapters alone, which peft.PeftModel.from_pretrained
loads onto the Hugging Face base model.

Every subcommand refuses an uncommitted checkpoint (step-N.partial, .replaced, .deleting) and a damaged one, and
reads a DCP folder without dtrain's commit record (from elsewhere) with one warning. to-hf and to-peft write into a
new or empty folder, or replace an earlier export of the same kind there (tool_checks.py, export_folder.py).
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import datetime
import sys
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.config_checks import model_record
from dtrain.checkpoint.export_folder import check_export_folder, write_export
from dtrain.checkpoint.folders import CommitRecord, commit
from dtrain.checkpoint.hf_io import CONFIG_FILE, build_adapter, iter_hf_weights, read_hf_config, save_hf, token_ids
from dtrain.checkpoint.peft_export import lora_run_weights, save_merged_hf, save_peft_adapter
from dtrain.checkpoint.peft_names import is_lora
from dtrain.checkpoint.tool_checks import check_config_agrees, read_checkpoint_record, refuse_uncommitted
from dtrain.errors import DtrainError
from dtrain.parallelize import FAMILIES, get_family
from dtrain.precision.lora import apply_lora
from dtrain.run.hf_start import family_of

DTYPES = dcp_io.EXPORT_DTYPES  # the dtypes of checkpoint.export_dtype


class RunConfig(NamedTuple):
    """The run that wrote a checkpoint, as its config describes it: model family and args, the config, and where the
    config came from (for messages)."""

    family: str
    args: Any
    cfg: Any
    source: str


def run_config(checkpoint: Path, config: Path | None) -> RunConfig:
    """The run of `checkpoint`, from its resolved config.toml (or `config`)."""
    from dtrain.config import load_config
    from dtrain.data import build_tokenizer
    from dtrain.run.prepare import model_args, model_family

    source = f"--config {config}" if config else None
    config = config or checkpoint.resolve().parent.parent / "config.toml"
    if not config.is_file():
        raise DtrainError(f"{config} not found; pass --config with the run's config.toml")
    cfg = load_config(["--config", str(config)])
    family, start = model_family(cfg)  # as training resolves it: the config may name no flavor
    args = model_args(cfg, family.model, build_tokenizer(cfg.model).vocab_size, start)
    return RunConfig(family.name, args, cfg, source or f"the run's config {config}")


def checked_record(checkpoint: Path, run: RunConfig) -> CommitRecord | None:
    """The commit record of `checkpoint` (None for one from elsewhere), after refusing a run config that describes
    another model or [lora] than it records."""
    record = read_checkpoint_record(checkpoint, "checkpoint")
    check_config_agrees(checkpoint, record, run.source, model_record(run.cfg.model, run.args), run.cfg.lora)
    return record


def expected_shapes(family_name: str, args, lora=None) -> dict[str, tuple[int, ...]]:
    """{FQN: shape} of the model of `args` (with the adapters of `lora`, the [lora] section, where enabled)."""
    with torch.device("meta"):
        model = get_family(family_name).model.model_cls(args)
    if lora is not None and lora.enable:
        apply_lora(model, lora)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def run_weights(checkpoint: Path, family: str, args, cfg, adapter) -> dict[str, torch.Tensor]:
    """Every weight of the run's checkpoint (a LoRA run's base included), refused unless they are its model's."""
    expected = expected_shapes(family, args, cfg.lora)
    if cfg.lora.enable:
        weights = lora_run_weights(checkpoint, adapter, [fqn for fqn in expected if not is_lora(fqn)])
    else:
        weights = dcp_io.read_full_weights(checkpoint)
    if {k: tuple(v.shape) for k, v in weights.items()} != expected:
        raise DtrainError(f"{checkpoint} does not hold the weights of the model its config describes")
    return weights


def to_hf(opts) -> None:
    refuse_uncommitted(opts.checkpoint, "checkpoint")
    run = run_config(opts.checkpoint, opts.config)
    family, args, cfg = run.family, run.args, run.cfg
    adapter = build_adapter(family, args)
    try:  # a model Hugging Face's class would compute differently is refused before anything is read or written
        adapter.hf_config(DTYPES[opts.dtype])
    except ValueError as err:
        raise DtrainError(f"cannot export {opts.checkpoint} to Hugging Face: {err}") from None
    checked_record(opts.checkpoint, run)
    check_export_folder(opts.out, "hf")
    weights = run_weights(opts.checkpoint, family, args, cfg, adapter)
    save = partial(save_merged_hf, lora=cfg.lora) if cfg.lora.enable else save_hf
    files = write_export(opts.out, "hf", lambda folder: save(
        weights, folder, adapter, dtype=DTYPES[opts.dtype], max_shard_bytes=int(opts.max_shard_gb * 2**30),
        special_tokens=token_ids(cfg.model, cfg.checkpoint)))
    merged = " (LoRA adapters merged into the base)" if cfg.lora.enable else ""
    print(f"wrote {len(files)} files to {opts.out}{merged}")


def check_lora_run(checkpoint: Path, record: CommitRecord | None, lora) -> None:
    """Refuse a checkpoint that holds no LoRA adapters, described by its record where it has one (checked_record has
    refused a config that contradicts it), else by its config's [lora] (`lora`)."""
    if record is not None and not record.lora:
        raise DtrainError(f"{checkpoint} is not a LoRA run's checkpoint (its commit record has no [lora] settings)")
    if record is None and not lora.enable:
        raise DtrainError(f"{checkpoint} has no commit record, and its config has lora.enable = false: no LoRA "
                          "adapters to export")


def to_peft(opts) -> None:
    refuse_uncommitted(opts.checkpoint, "checkpoint")
    run = run_config(opts.checkpoint, opts.config)
    family, args, cfg = run.family, run.args, run.cfg
    check_lora_run(opts.checkpoint, checked_record(opts.checkpoint, run), cfg.lora)
    check_export_folder(opts.out, "peft")
    adapter = build_adapter(family, args)
    adapters = {fqn: t for fqn, t in dcp_io.read_full_weights(opts.checkpoint).items() if is_lora(fqn)}
    expected = expected_shapes(family, args, cfg.lora)
    if {fqn: tuple(t.shape) for fqn, t in adapters.items()} != {k: v for k, v in expected.items() if is_lora(k)}:
        raise DtrainError(f"{opts.checkpoint} does not hold the adapters its config's [lora] describes")
    # The base's names and shapes tell PEFT's target_modules; its values are not needed.
    base = {fqn: torch.empty(shape, device="meta") for fqn, shape in expected.items() if not is_lora(fqn)}
    c = cfg.checkpoint
    base_path = c.initial_load_path if c.initial_load_in_hf and c.initial_load_path else None
    files = write_export(opts.out, "peft", lambda folder: save_peft_adapter(
        {**base, **adapters}, folder, adapter, cfg.lora, DTYPES[opts.dtype], base_model_name_or_path=base_path))
    of_base = f" of {base_path}" if base_path else ""
    print(f"wrote {len(files)} files to {opts.out} (PEFT LoRA adapter{of_base})")


def from_hf(opts) -> None:
    refuse_uncommitted(opts.hf_dir, "Hugging Face folder")  # a last_save_in_hf save that never committed
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
    read_checkpoint_record(opts.checkpoint, "checkpoint")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dcp_io.read_whole_state(opts.checkpoint), opts.out)
    print(f"wrote {opts.out}; read it with torch.load(path, weights_only=True)")


def default_export(checkpoint: Path, kind: str, suffix: str = "") -> Path:
    """Where an export goes when no folder is given: beside its run's checkpoints (`<run>/exports/<kind>-step-N`)
    for a run's step folder, else beside the checkpoint it came from; never the folder the command runs in."""
    step = checkpoint.absolute()
    if step.name.startswith("step-") and (step.parent.parent / "config.toml").is_file():
        return step.parent.parent / "exports" / f"{kind}-{step.name}{suffix}"
    return step.parent / f"{step.name}-{kind}{suffix}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    hf = commands.add_parser("to-hf", help="DCP checkpoint -> Hugging Face safetensors folder")
    hf.add_argument("checkpoint", type=Path)
    hf.add_argument("out", type=Path, nargs="?", help="default: <run>/exports/hf-step-N")
    hf.add_argument("--config", type=Path, default=None, help="the run's config.toml (default: <run>/config.toml)")
    hf.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    hf.add_argument("--max-shard-gb", type=float, default=5.0)
    back = commands.add_parser("from-hf", help="Hugging Face safetensors folder -> DCP model-only checkpoint")
    back.add_argument("hf_dir", type=Path)
    back.add_argument("out", type=Path)
    back.add_argument("--family", choices=sorted(FAMILIES), default=None,
                      help="model family (default: config.json's architectures / model_type)")
    back.add_argument("--dtype", choices=DTYPES, default="float32")
    lora = commands.add_parser("to-peft", help="a LoRA run's DCP checkpoint -> PEFT adapter folder")
    lora.add_argument("checkpoint", type=Path)
    lora.add_argument("out", type=Path, nargs="?", help="default: <run>/exports/peft-step-N")
    lora.add_argument("--config", type=Path, default=None, help="the run's config.toml (default: <run>/config.toml)")
    lora.add_argument("--dtype", choices=DTYPES, default="float32")
    plain = commands.add_parser("to-torch", help="DCP checkpoint -> one torch.save file")
    plain.add_argument("checkpoint", type=Path)
    plain.add_argument("out", type=Path, nargs="?", help="default: <run>/exports/torch-step-N.pt")
    opts = parser.parse_args(argv)
    kinds = {"to-hf": ("hf", ""), "to-peft": ("peft", ""), "to-torch": ("torch", ".pt")}
    if opts.command in kinds and opts.out is None:
        opts.out = default_export(opts.checkpoint, *kinds[opts.command])
    try:
        {"to-hf": to_hf, "from-hf": from_hf, "to-torch": to_torch, "to-peft": to_peft}[opts.command](opts)
    except DtrainError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
