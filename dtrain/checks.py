"""Everything about a run that can be checked before any process group or run directory exists.

`prepare` resolves the model family, tokenizer, model hyperparameters and parallel degrees for the coming world
size, raising a one-line DtrainError on the first problem; the trainer then starts from what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dtrain.checkpoint.config_checks import check_checkpoint_config
from dtrain.config.schema import JobConfig
from dtrain.data import build_tokenizer
from dtrain.distributed import world_size_from_env
from dtrain.errors import ConfigError
from dtrain.layout import check_layout
from dtrain.models import ModelFamily
from dtrain.parallelize import FamilySpec, get_family


@dataclass(frozen=True)
class Prepared:
    family: FamilySpec
    tokenizer: Any
    model_args: Any


def model_args(cfg: JobConfig, family: ModelFamily, tokenizer_vocab: int):
    """The flavor's hyperparameters, with the vocabulary sized for the tokenizer and room for seq_len."""
    if cfg.model.flavor not in family.flavors:
        valid = ", ".join(family.flavors)
        raise ConfigError(f"model.flavor '{cfg.model.flavor}' is not a {family.name} flavor (valid: {valid})")
    base = family.flavors[cfg.model.flavor]
    multiple = cfg.model.vocab_size_multiple_of
    tie = base.tie_word_embeddings if cfg.model.tie_word_embeddings is None else cfg.model.tie_word_embeddings
    return replace(
        base,
        vocab_size=-(-tokenizer_vocab // multiple) * multiple,
        max_seq_len=max(base.max_seq_len, cfg.training.seq_len),
        tie_word_embeddings=tie,
    )


def prepare(cfg: JobConfig) -> Prepared:
    try:
        family = get_family(cfg.model.name)
    except ValueError as err:
        raise ConfigError(f"model.name: {err}") from None
    tokenizer = build_tokenizer(cfg.model)
    args = model_args(cfg, family.model, tokenizer.vocab_size)
    check_layout(cfg, world_size_from_env(), family, args)
    check_checkpoint_config(cfg, world_size_from_env())
    return Prepared(family, tokenizer, args)
