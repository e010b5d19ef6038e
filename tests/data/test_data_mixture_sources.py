"""What a mixture's loader tells the step and the log about sources: each label's source in the batch, each
source's name, and each source's tokens so far (also after a resume)."""

from __future__ import annotations

import numpy as np
import pytest
from test_data_mixture import RepeatedLetter, mixture_loader, source_of

from dtrain.config.dataset_mixture import BLOCK, MixtureEntry
from dtrain.data import ByteTokenizer
from dtrain.data.dataloader import DataLoader
from dtrain.data.mixture import Interleave, source_names


def test_every_label_carries_the_index_of_its_window_s_source_on_every_rank():
    for rank in range(2):
        loader = mixture_loader(rank=rank, dp=2, lbs=3)
        for _ in range(4):
            batch = next(loader)
            assert batch["source_ids"].shape == batch["labels"].shape
            for window, sources in zip(batch["input_ids"], batch["source_ids"]):
                assert (sources == sources[0]).all()
                assert "abc"[int(sources[0])] == source_of(window)


def test_one_source_adds_no_source_ids_and_no_per_source_counts():
    loader = DataLoader(RepeatedLetter("a"), ByteTokenizer(), 8, 2, 0, 1)
    assert "source_ids" not in next(loader)
    assert loader.source_names == () and loader.tokens_seen_by_source() == {}


def test_tokens_seen_by_source_count_the_handed_out_samples_and_survive_a_resume():
    loader = mixture_loader(lbs=4, weights=(0.5, 0.3, 0.2))
    owners = []
    for _ in range(5):
        owners.append(next(loader)["source_ids"][:, 0])
    counted = np.bincount(np.concatenate(owners), minlength=3) * 8  # seq_len 8: tokens as tokens_seen counts them
    seen = loader.tokens_seen_by_source()
    assert list(seen) == ["tokens_seen/source0", "tokens_seen/source1", "tokens_seen/source2"]
    assert list(seen.values()) == counted.tolist() and sum(seen.values()) == 5 * 4 * 8
    resumed = mixture_loader(lbs=4, weights=(0.5, 0.3, 0.2))
    resumed.load_state_dict(loader.state_dict())
    assert resumed.tokens_seen_by_source() == seen


@pytest.mark.parametrize("count", [0, 1, 999, BLOCK, 2 * BLOCK + 4321])
def test_samples_before_counts_the_pattern(count):
    interleave = Interleave([0.6, 0.3, 0.1])
    assert interleave.samples_before(count).tolist() == np.bincount(
        interleave.sources(0, count), minlength=3
    ).tolist()


def test_source_names_are_short_tag_safe_and_distinct():
    entries = [
        MixtureEntry("tokens", "/data/web/", 0.5),
        MixtureEntry("files", "/data/code.jsonl", 0.2),
        MixtureEntry("builtin", "", 0.1),
        MixtureEntry("builtin", "", 0.1),
        MixtureEntry("hf", "my data/wiki pedia", 0.1),
    ]
    assert source_names(entries) == ["web", "code", "builtin", "builtin_3", "wiki_pedia"]
