"""Everything about a run that can be checked before any process group or run directory exists.

`prepare` resolves the model family, tokenizer, model hyperparameters and parallel degrees for the coming world
size, raising a one-line DtrainError on the first problem; the trainer then starts from what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtrain.checkpoint.config_checks import check_checkpoint_config
from dtrain.config.schema import JobConfig
from dtrain.data import build_tokenizer
from dtrain.distributed import world_size_from_env
from dtrain.errors import ConfigError
from dtrain.layout import check_layout
from dtrain.model_args import apply_overrides, shape_table, typed_overrides
from dtrain.models import ModelFamily
from dtrain.parallelize import FamilySpec, get_family


@dataclass(frozen=True)
class Prepared:
    family: FamilySpec
    tokenizer: Any
    model_args: Any


def model_args(cfg: JobConfig, family: ModelFamily, tokenizer_vocab: int):
    """The flavor's hyperparameters with the `[model.args]` overrides, the vocabulary sized for the tokenizer
    (unless model.args.vocab_size gives a larger one) and room for seq_len."""
    if cfg.model.flavor not in family.flavors:
        valid = ", ".join(family.flavors)
        raise ConfigError(f"model.flavor '{cfg.model.flavor}' is not a {family.name} flavor (valid: {valid})")
    overrides = typed_overrides(family, cfg.model.args)
    base = apply_overrides(family, family.flavors[cfg.model.flavor], overrides)
    multiple = cfg.model.vocab_size_multiple_of
    vocab_size = -(-tokenizer_vocab // multiple) * multiple
    if "vocab_size" in overrides:
        if overrides["vocab_size"] < tokenizer_vocab:
            raise ConfigError(
                f"model.args.vocab_size={overrides['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab} "
                "tokens (valid: at least that, or unset to size it from the tokenizer)"
            )
        vocab_size = overrides["vocab_size"]
    tie = base.tie_word_embeddings if cfg.model.tie_word_embeddings is None else cfg.model.tie_word_embeddings
    return apply_overrides(
        family,
        base,
        dict(vocab_size=vocab_size, max_seq_len=max(base.max_seq_len, cfg.training.seq_len), tie_word_embeddings=tie),
    )


def prepare(cfg: JobConfig) -> Prepared:
    try:
        family = get_family(cfg.model.name)
    except ValueError as err:
        raise ConfigError(f"model.name: {err}") from None
    tokenizer = build_tokenizer(cfg.model)
    args = model_args(cfg, family.model, tokenizer.vocab_size)
    # The run's config.toml records the shape it trains, so that it rebuilds the same model by itself.
    cfg.model.args = shape_table(args)
    check_layout(cfg, world_size_from_env(), family, args)
    check_checkpoint_config(cfg, world_size_from_env())
    return Prepared(family, tokenizer, args)
