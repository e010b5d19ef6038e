"""Weighted mixtures of datasets: the interleave, its proportions, dp-independence, resume, and config errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtrain.config.dataset_mixture import BLOCK, MIXABLE_KINDS, block_counts, parse_mixture
from dtrain.data import ByteTokenizer
from dtrain.data.dataloader import DataLoader
from dtrain.data.mixture import Interleave
from dtrain.data.sources import DocumentSource
from dtrain.errors import ConfigError


class RepeatedLetter(DocumentSource):
    """Endless documents of one letter, so that every window tells which source it came from."""

    endless = True

    def __init__(self, letter: str, length: int = 5):
        self.letter, self.length = letter, length
        self.description = f"documents of {letter!r}"

    def documents(self, start=0):
        position = start
        while True:
            yield position, self.letter * (self.length + position % 3)
            position += 1


def source_of(window: torch.Tensor) -> str:
    letters = {chr(int(t)) for t in window if int(t) < 256}
    assert len(letters) == 1, letters  # windows of one source only
    return letters.pop()


def mixture_loader(rank=0, dp=1, lbs=4, weights=(0.7, 0.2, 0.1)):
    sources = [RepeatedLetter(letter) for letter in "abc"]
    return DataLoader(sources, ByteTokenizer(), 8, lbs, rank, dp, weights=list(weights))


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [5, 1], [0.001, 0.999], [3, 2, 2, 1]])
def test_each_block_holds_every_source_in_proportion(weights):
    counts = block_counts(weights)
    assert counts.sum() == BLOCK
    assert np.all(np.abs(counts / BLOCK - np.array(weights) / sum(weights)) <= 1 / BLOCK)
    pattern = Interleave(weights).sources(0, BLOCK)
    assert np.array_equal(np.bincount(pattern, minlength=len(weights)), counts)
    # Spread evenly: every run of 100 samples is within a few samples of the proportions.
    shares = np.array(weights) / sum(weights)
    for start in range(0, BLOCK, 100):
        seen = np.bincount(Interleave(weights).sources(start, 100), minlength=len(weights))
        assert np.all(np.abs(seen - 100 * shares) <= 2)


def test_the_pattern_repeats_block_after_block():
    interleave = Interleave([0.6, 0.4])
    assert np.array_equal(interleave.sources(3 * BLOCK + 17, 500), interleave.sources(17, 500))


def test_batches_mix_the_sources_in_proportion():
    data = mixture_loader(lbs=50)
    seen = [source_of(window) for _ in range(20) for window in next(data)["input_ids"]]
    shares = {letter: seen.count(letter) / len(seen) for letter in "abc"}
    assert shares == pytest.approx({"a": 0.7, "b": 0.2, "c": 0.1}, abs=0.005)


def test_ranks_together_see_the_one_process_batches_and_resume_across_dp():
    single = mixture_loader(lbs=4)
    expected = [next(single)["input_ids"] for _ in range(6)]
    ranks = [mixture_loader(rank=r, dp=2, lbs=2) for r in range(2)]
    for step in range(3):
        assert torch.equal(torch.cat([next(r)["input_ids"] for r in ranks]), expected[step])
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()  # global, the same on every rank
    assert set(state) == {"sequences_consumed"} | {
        f"source{i}_{key}" for i in range(3) for key in ("epoch", "document_position", "token_offset")
    }
    resumed = mixture_loader(lbs=4)  # dp 2 -> dp 1
    resumed.load_state_dict(state)
    for step in range(3, 6):
        assert torch.equal(next(resumed)["input_ids"], expected[step])


def test_a_state_without_the_mixtures_sources_is_refused():
    data = mixture_loader()
    with pytest.raises(Exception, match="lacks source0_epoch"):
        data.load_state_dict({"sequences_consumed": 0, "epoch": 0, "document_position": 0, "token_offset": 0})


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "needs training.dataset_mixture"),
        ([["files"]], r"give \[kind, weight\] or \[kind, path, weight\]"),
        ([["parquet", "/d", "1"]], "kind 'parquet' is not one of builtin"),
        ([["builtin", "much"]], "weight 'much' is not a number"),
        ([["builtin", "0"]], "positive finite"),
        ([["builtin", "-1"]], "positive finite"),
        ([["builtin", "1"], ["synthetic", "0.00001"]], "entry 1: its weight is below 1/10000"),
        ([["mixture", "1"]], "kind 'mixture' is not one of"),
    ],
)
def test_malformed_entries_are_one_line_errors_naming_the_entry(entries, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_mixture(entries, MIXABLE_KINDS)
    assert "\n" not in str(caught.value)


def test_entries_parse_with_and_without_a_path():
    parsed = parse_mixture([["builtin", "2"], ["tokens", "/data/web", "0.5"]], MIXABLE_KINDS)
    assert [(e.kind, e.path, e.weight) for e in parsed] == [("builtin", "", 2.0), ("tokens", "/data/web", 0.5)]
