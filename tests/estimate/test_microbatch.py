"""The microbatch rule: every candidate is measured and ranked by (B/(d·b) + p − 1)(t_f + t_b), and the
recommendation never needs more memory than the device has."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.estimate import load_hardware
from dtrain.estimate.microbatch import advise_microbatch, candidate_sizes, format_advice

ARGS = ["--config", "debug_model.toml", "--parallelism.pipeline_parallel_degree", "2",
        "--training.local_batch_size", "8", "--training.seq_len", "64"]


def test_candidates_divide_the_ranks_batch():
    assert candidate_sizes(8) == [1, 2, 4, 8] and candidate_sizes(6) == [1, 2, 3, 6]


def test_the_ranking_follows_the_rule_and_the_advice_fits_memory():
    cfg = load_config(ARGS)
    cpu = load_hardware("cpu")
    ranked = advise_microbatch(cfg, 4, cpu, torch.device("cpu"), repeats=1)
    assert [c.microbatch_size for c in sorted(ranked, key=lambda c: c.microbatch_size)] == [1, 2, 4]  # 8: too few
    for c in ranked:  # per rank B/d = 8 sequences, p = 2
        assert c.step_s == pytest.approx((8 / c.microbatch_size + 1) * (c.forward_s + c.backward_s))
    assert [c.step_s for c in ranked] == sorted(c.step_s for c in ranked)
    memory = {c.microbatch_size: c.memory_bytes for c in ranked}
    assert memory[1] < memory[2] < memory[4]
    # A device that holds microbatches of 1 only: whatever the timings, the advice is 1.
    small = replace(cpu, memory_gib=(memory[1] + memory[2]) / 2 / 2**30)
    ranked = advise_microbatch(cfg, 4, small, torch.device("cpu"), repeats=1)
    assert ranked[0].microbatch_size == 1 and ranked[0].fits and not any(c.fits for c in ranked[1:])
    assert "recommended: --parallelism.pipeline_parallel_microbatch_size 1" in format_advice(ranked, small)
    tiny = replace(cpu, memory_gib=memory[1] / 2 / 2**30)
    assert "no microbatch size fits" in format_advice(advise_microbatch(cfg, 4, tiny, torch.device("cpu"), 1), tiny)


def test_without_a_pipeline_it_is_refused():
    with pytest.raises(ConfigError, match="set parallelism.pipeline_parallel_degree > 1"):
        advise_microbatch(load_config(["--config", "debug_model.toml"]), 2, load_hardware("cpu"), torch.device("cpu"))
