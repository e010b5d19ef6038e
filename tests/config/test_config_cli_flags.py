"""Command-line flag syntax: both forms, hyphens, booleans, lists, none, and one-line errors."""

from __future__ import annotations

import pytest

from dtrain.config import help_requested
from dtrain.config.cli import parse_argv
from dtrain.errors import ConfigError


def test_both_forms_and_hyphens(load):
    cfg = load(["--training.steps", "12", "--optimizer.lr=1e-4", "--lr-scheduler.warmup-steps", "3"])
    assert (cfg.training.steps, cfg.optimizer.lr, cfg.lr_scheduler.warmup_steps) == (12, 1e-4, 3)


def test_values_may_contain_equals_and_start_with_dash(load):
    cfg = load(["--job.description=a=b", "--training.global_batch_size", "-1", "--checkpoint.load_step=-1"])
    assert cfg.job.description == "a=b"
    assert cfg.training.global_batch_size == -1


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--checkpoint.enable"], True),
        (["--checkpoint.no_enable"], False),
        (["--checkpoint.no-enable"], False),
        (["--checkpoint.enable", "false"], False),
        (["--checkpoint.enable", "TRUE"], True),
        (["--checkpoint.enable", "0"], False),
        (["--checkpoint.enable", "1"], True),
        (["--checkpoint.enable", "no"], False),
        (["--checkpoint.enable", "yes"], True),
        (["--checkpoint.enable=false"], False),
        (["--checkpoint.enable=Yes"], True),
        (["--checkpoint.enable", "--training.steps", "3"], True),
    ],
)
def test_boolean_forms(load, argv, expected):
    assert load(argv).checkpoint.enable is expected


def test_bare_boolean_does_not_swallow_a_positional(load):
    with pytest.raises(ConfigError, match="unexpected argument 'maybe'"):
        load(["--checkpoint.enable", "maybe"])


def test_boolean_errors(load):
    with pytest.raises(ConfigError, match=r"checkpoint.enable expects true/false, 1/0 or yes/no, got 'maybe'"):
        load(["--checkpoint.enable=maybe"])
    with pytest.raises(ConfigError, match="--checkpoint.no_enable takes no value"):
        load(["--checkpoint.no_enable=true"])
    with pytest.raises(ConfigError, match="training.steps is not a boolean"):
        load(["--training.no_steps"])


def test_optional_boolean_accepts_none(load):
    assert load(["--model.tie_word_embeddings"]).model.tie_word_embeddings is True
    assert load(["--model.tie_word_embeddings", "none"]).model.tie_word_embeddings is None
    assert load(["--model.no_tie_word_embeddings"]).model.tie_word_embeddings is False


def test_lists(load):
    assert load(["--compile.components", "model"]).compile.components == ["model"]
    assert load(["--compile.components=loss, model"]).compile.components == ["loss", "model"]
    assert load(["--compile.components", ""]).compile.components == []
    assert load(["--checkpoint.exclude_from_loading", "optimizer,dataloader"]).checkpoint.exclude_from_loading == [
        "optimizer",
        "dataloader",
    ]


def test_optional_none_and_values(load):
    assert load(["--lr_scheduler.decay_ratio", "0.2"]).lr_scheduler.decay_ratio == 0.2
    assert load(["--lr_scheduler.decay_ratio", "None"]).lr_scheduler.decay_ratio is None
    cfg = load(["--parallelism.pipeline_parallel_layers_per_stage", "2"])
    assert cfg.parallelism.pipeline_parallel_layers_per_stage == 2
    with pytest.raises(ConfigError, match="expects an integer or none, got 'two'"):
        load(["--parallelism.pipeline_parallel_layers_per_stage", "two"])
    # A non-optional string key keeps "none" as text (it is a valid activation_checkpoint.mode).
    assert load(["--activation_checkpoint.mode", "none"]).activation_checkpoint.mode == "none"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.steps", "ten"], "training.steps expects an integer, got 'ten'"),
        (["--training.steps", "1.5"], "training.steps expects an integer, got '1.5'"),
        (["--training.steps", "1_000"], "training.steps expects an integer, got '1_000'"),
        (["--optimizer.lr", "abc"], "optimizer.lr expects a number, got 'abc'"),
        (["--optimizer.lr", "inf"], "optimizer.lr expects a finite number, got 'inf'"),
        (
            ["--lr_scheduler.decay_type", "exp"],
            "lr_scheduler.decay_type must be one of linear, sqrt, cosine; got 'exp'",
        ),
        (
            ["--optimizer.name", "AdamW9bit"],
            "optimizer.name must be one of AdamW, Adam, AdamW8bit, AdamW4bit, AdamWFp8, Adam8bit, Adam4bit, AdamFp8; "
            "got 'AdamW9bit'",
        ),
        (
            ["--training.attention_mask", "document"],
            "training.attention_mask must be one of causal, block_causal; got 'document'",
        ),
        (["--training.steps", "0"], "training.steps must be >= 1; got 0"),
        (["--optimizer.lr=-0.1"], "optimizer.lr must be >= 0; got -0.1"),
        (["--training.steps"], "--training.steps expects a value (an integer)"),
        (["--training.steps", "--optimizer.lr", "1"], "--training.steps expects a value (an integer)"),
        (["debug_model"], "unexpected argument 'debug_model'"),
        (["-x"], "unexpected argument '-x'"),
        (["--training.stepz", "3"], "unknown key training.stepz (did you mean training.steps?)"),
        (["--trainin.steps", "3"], "unknown key trainin.steps (did you mean training.steps?)"),
        (["--steps", "3"], "unknown key steps (did you mean training.steps?)"),
        (
            ["--training.warmup_steps", "3"],
            "unknown key training.warmup_steps (did you mean lr_scheduler.warmup_steps?)",
        ),
        (["--training.qqqq", "3"], "unknown key training.qqqq (keys of training: dataset, "),
        (["--nosuch.thing", "3"], "unknown key nosuch.thing (sections: job, model, "),
    ],
)
def test_errors_are_one_line_and_name_the_key(load, argv, message):
    with pytest.raises(ConfigError) as err:
        load(argv)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert err.value.exit_code == 2


def test_choices_are_case_insensitive_and_canonicalized(load):
    cfg = load(["--optimizer.name", "adamw", "--parallelism.pipeline_parallel_schedule", "interleaved1f1b"])
    assert cfg.optimizer.name == "AdamW"
    assert cfg.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"


def test_help_flags():
    assert help_requested(["--training.steps", "3", "-h"])
    assert help_requested(["--help"])
    assert not help_requested(["--training.steps", "3"])
    parsed = parse_argv(["--help", "--config", "x", "--training.steps", "2"])
    assert parsed.help and parsed.config == "x"
    assert [(spec.key, value) for spec, value in parsed.overrides] == [("training.steps", 2)]


def test_load_config_ignores_help_so_help_can_show_resolved_values(load):
    assert load(["--training.steps", "3", "--help"]).training.steps == 3
