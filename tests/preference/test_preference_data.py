"""Preference data and settings: the formats TRL reads, answer-only labels, pairs kept whole, the length policy's
one line, and the one-line refusals of bad rows and settings."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from dtrain.config import load_config
from dtrain.config.schema import JobConfig
from dtrain.data.dataloader import build_dataloader
from dtrain.data.preference_samples import _answer_start
from dtrain.data.tokenizer_factory import build_tokenizer
from dtrain.errors import ConfigError, DataError
from dtrain.step.labels import IGNORE_INDEX

# Rows, tokens and one-line refusals: nothing torch's version changes.
pytestmark = [pytest.mark.torch_independent]

USER, GOOD, BAD = [{"role": "user", "content": "2 + 2?"}], {"role": "assistant", "content": "4"}, \
    {"role": "assistant", "content": "5"}


def loader(tmp_path, rows: list[dict], dp_rank: int = 0, dp_size: int = 1, **preference):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = JobConfig()
    cfg.training.dataset, cfg.training.dataset_path = "preference", str(path)
    cfg.training.seq_len, cfg.training.local_batch_size = 64, 2
    for key, value in preference.items():
        setattr(cfg.training.preference, key, value)
    tokenizer = build_tokenizer(cfg.model)
    return build_dataloader(cfg.training, tokenizer, dp_rank, dp_size, seed=0), tokenizer


def answers(batch: dict, tokenizer) -> list[str]:
    """The trained tokens of each sequence, as text (EOS as '$')."""
    texts = []
    for labels in batch["labels"]:
        kept = [int(t) for t in labels if t != IGNORE_INDEX]
        texts.append("".join("$" if t == tokenizer.eos_id else tokenizer.decode([t]) for t in kept))
    return texts


def test_explicit_implicit_and_plain_pairs_train_only_their_answers(tmp_path):
    system = {"role": "system", "content": "Be brief."}
    rows = [
        {"prompt": USER, "chosen": [GOOD], "rejected": [BAD]},  # explicit, conversational
        {"chosen": [system, *USER, GOOD], "rejected": [system, *USER, BAD]},  # implicit: the shared start
        {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"},  # plain text: no template, EOS appended
        # A multi-turn prompt: its own assistant turn is context, not trained.
        {"prompt": [*USER, GOOD, {"role": "user", "content": "Sure?"}], "chosen": "Yes", "rejected": "No"},
    ]
    data, tokenizer = loader(tmp_path, rows)
    first, second = next(data), next(data)
    # Each batch: 2 pairs, their 2 chosen sequences then their 2 rejected ones.
    assert first["input_ids"].shape == (4, 64)
    assert answers(first, tokenizer) == ["4$", "4$", "5$", "5$"]
    assert answers(second, tokenizer) == [" 4$", "Yes$", " 5$", "No$"]
    text = tokenizer.decode([int(t) for t in second["input_ids"][0] if t < 256])
    assert text == "2 + 2 = 4"  # BOS + prompt + answer + EOS, tokenized as text


def test_a_pair_is_never_split_between_ranks(tmp_path):
    rows = [{"prompt": f"{i} + 1 =", "chosen": f" {i + 1}", "rejected": f" {i}"} for i in range(8)]
    seen = []
    for rank in range(2):
        data, tokenizer = loader(tmp_path, rows, dp_rank=rank, dp_size=2)
        batch = next(data)
        chosen, rejected = batch["input_ids"].chunk(2)
        for c, r in zip(chosen, rejected):
            prompt_c, prompt_r = (tokenizer.decode([int(t) for t in s[:7] if t < 256]) for s in (c, r))
            assert prompt_c == prompt_r  # the chosen and the rejected sequence of one pair, side by side
            seen.append(prompt_c)
    assert len(set(seen)) == 4  # 2 ranks x 2 pairs, the first 4 of the global order


def test_long_pairs_follow_the_policy_and_are_counted_in_one_line(tmp_path, caplog):
    long = {"prompt": [{"role": "user", "content": "x" * 30}], "chosen": "a" * 20, "rejected": "b"}
    too_long = {"prompt": [{"role": "user", "content": "y" * 60}], "chosen": "a", "rejected": "b"}
    rows = [{"prompt": USER, "chosen": [GOOD], "rejected": [BAD]}, long, too_long]
    with caplog.at_level(logging.INFO, logger="dtrain"):
        data, tokenizer = loader(tmp_path, rows)
        batch = next(data)
        next(data)  # the second batch starts the next pass: the first one is reported
    # BOS + "User: " + 30 x + "\n" + "Assistant: " is 49 tokens: 16 of the answer fit in seq_len + 1 = 65.
    assert answers(batch, tokenizer)[1] == "a" * 16
    lines = [r.getMessage() for r in caplog.records if "preference data, one pass" in r.getMessage()]
    assert len(lines) == 1 and "3 pairs, 1 dropped" in lines[0] and "1 truncated" in lines[0], lines
    data, _ = loader(tmp_path, rows, overlong_policy="drop")
    assert data.sources[0].samples_per_pass() == 1


@pytest.mark.parametrize("row, message", [
    ({"prompt": USER, "chosen": [GOOD]}, "has no field 'rejected'"),
    ({"prompt": USER, "chosen": [GOOD], "rejected": [GOOD]}, "the chosen and the rejected answer are the same"),
    ({"prompt": USER, "chosen": [GOOD], "rejected": [{"role": "user", "content": "5"}]}, "does not end with an "
     "assistant turn"),
])
def test_bad_rows_are_refused_in_one_line_naming_the_row(tmp_path, row, message):
    with pytest.raises(DataError, match=message) as refused:
        loader(tmp_path, [row])
    assert "pairs.jsonl" in str(refused.value) and "\n" not in str(refused.value)


def test_an_answer_empty_after_templating_is_refused():
    # The template marked the prompt's assistant turn and none of the answer's: nothing of the answer would train.
    targets = np.array([False, True, True, False, False])
    with pytest.raises(DataError, match="the chosen answer is empty after templating"):
        _answer_start(targets, [*USER, GOOD], [GOOD], "chosen", "line 1")


@pytest.mark.parametrize("flags, message", [
    (["--training.preference.beta", "0"], "training.preference.beta must be > 0; got 0"),
    (["--training.preference.loss", "kto"], "sigmoid, ipo, simpo, orpo"),
    (["--training.preference.reference", "adapters"], "needs lora.enable = true"),
    (["--parallelism.tensor_parallel_degree", "2"], "parallelism.tensor_parallel_degree must be 1"),
])
def test_bad_settings_are_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", "debug_dpo", *flags])
