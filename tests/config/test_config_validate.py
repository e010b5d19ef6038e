"""validate_config: cross-field and meaning checks that need no world size."""

from __future__ import annotations

import pytest

from dtrain.config import JobConfig, validate_config
from dtrain.errors import ConfigError


def _config(**sections) -> JobConfig:
    """JobConfig() with fields changed, e.g. _config(training={"seq_len": 1})."""
    cfg = JobConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def test_defaults_are_valid():
    validate_config(JobConfig())


@pytest.mark.parametrize(
    "sections",
    [
        {"lr_scheduler": {"warmup_steps": 50}, "training": {"steps": 10}},  # warmup beyond steps is allowed
        {"lr_scheduler": {"decay_ratio": 0.0}},
        {"lr_scheduler": {"decay_ratio": 1.0}},
        {"training": {"global_batch_size": 32, "local_batch_size": 8}},
        {"activation_checkpoint": {"selective_ac_option": "op"}},
        {"activation_checkpoint": {"selective_ac_option": "3"}},
        {"compile": {"components": []}},
        {"compile": {"cache": True, "cache_dir": "/shared/compile_cache"}},
        {"compile": {"debug_dir": "compile_debug"}},
        {"parallelism": {"pipeline_parallel_schedule": "zbvzerobubble"}},
        {"parallelism": {"enable_async_tensor_parallel": True}, "compile": {"enable": True}},
        {"training": {"dataset": "files", "dataset_path": "/data"}},
        {"training": {"attention_mask": "block_causal"}},
        {"optimizer": {"name": "Adam4bit"}},
    ],
)
def test_valid_combinations(sections):
    validate_config(_config(**sections))


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"lr_scheduler": {"decay_ratio": 1.5}}, "lr_scheduler.decay_ratio must be in [0, 1]"),
        ({"lr_scheduler": {"decay_ratio": -0.1}}, "lr_scheduler.decay_ratio must be >= 0"),
        ({"lr_scheduler": {"min_lr_factor": 2.0}}, "lr_scheduler.min_lr_factor must be in [0, 1]"),
        ({"activation_checkpoint": {"selective_ac_option": "0"}}, "selective_ac_option must be a positive integer"),
        ({"activation_checkpoint": {"selective_ac_option": "ops"}}, "selective_ac_option must be a positive integer"),
        ({"activation_checkpoint": {"selective_ac_option": "²"}}, "selective_ac_option must be a positive integer"),
        ({"compile": {"components": ["model", "optimizer"]}}, "compile.components may contain model, loss; got"),
        ({"compile": {"debug_dir": "/tmp/code"}}, "compile.debug_dir must be a relative folder inside job.dump"),
        ({"compile": {"debug_dir": "../code"}}, "compile.debug_dir must be a relative folder inside job.dump"),
        ({"compile": {"debug_dir": "code", "cache": True}}, "compile.debug_dir compiles the first step without"),
        ({"training": {"global_batch_size": 12, "local_batch_size": 8}}, "training.global_batch_size must be -1 or"),
        ({"training": {"global_batch_size": 0}}, "training.global_batch_size must be -1 or"),
        ({"parallelism": {"pipeline_parallel_schedule": "2F2B"}}, "pipeline_parallel_schedule must be one of GPipe"),
        ({"optimizer": {"beta1": 1.0}}, "optimizer.beta1 must be in [0, 1)"),
        ({"optimizer": {"beta2": 1.5}}, "optimizer.beta2 must be in [0, 1)"),
        (
            {"optimizer": {"name": "AdamW8bit", "implementation": "fused"}},
            "optimizer.implementation = fused applies to torch's AdamW and Adam only; torchao's AdamW8bit compiles",
        ),
        ({"training": {"seq_len": 1}}, "training.seq_len must be >= 2"),
        ({"parallelism": {"data_parallel_shard_degree": 0}}, "parallelism.data_parallel_shard_degree must be -1"),
        (
            {"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 3}},
            "training.local_batch_size (8) must be a multiple of parallelism.pipeline_parallel_microbatch_size (3)",
        ),
        ({"parallelism": {"enable_async_tensor_parallel": True}}, "parallelism.enable_async_tensor_parallel needs"),
        (
            {"parallelism": {"expert_tensor_parallel_degree": 2}},
            "parallelism.expert_tensor_parallel_degree = 2 is not supported: splitting each routed expert",
        ),
        ({"training": {"dataset": "hf"}}, "training.dataset = hf needs training.dataset_path"),
        ({"model": {"tokenizer": "tiktoken"}}, "model.tokenizer = tiktoken needs model.hf_assets_path"),
        (
            {"profiling": {"enable_profiling": True, "profile_freq": 3, "profiler_warmup": 3}},
            "profiling.profiler_warmup + profiling.profiler_active (3 + 1) must be <= profiling.profile_freq (3)",
        ),
        ({"job": {"dump_folder": ""}}, "job.dump_folder must not be empty"),
        ({"lora": {"enable": True, "alpha": 0.0}}, "lora.alpha must be > 0 (updates are scaled by alpha / rank"),
        (
            {"fault_tolerance": {"enable": True, "group_size": 2, "semi_sync_method": "diloco", "outer_momentum": 1.0}},
            "fault_tolerance.outer_momentum must be in [0, 1); got 1",
        ),
        # Fields set in Python are type- and choice-checked too.
        ({"training": {"steps": "10"}}, "training.steps expects an integer, got '10'"),
        ({"model": {"tokenizer": "sentencepiece"}}, "model.tokenizer must be one of auto, byte, hf, tiktoken"),
    ],
)
def test_invalid_configs(sections, message):
    with pytest.raises(ConfigError) as err:
        validate_config(_config(**sections))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_load_config_validates(load):
    with pytest.raises(ConfigError, match="training.seq_len must be >= 2"):
        load(["--training.seq_len", "1"])
