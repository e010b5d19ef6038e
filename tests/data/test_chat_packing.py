"""Chat windows in the data loader: labels only on assistant tokens, explicit documents, padding, the overlong
policy, and an exact resume."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import pytest
import torch

from dtrain.config.schema import DataLoader as DataLoaderConfig, JobConfig
from dtrain.config.schema_chat import Chat
from dtrain.data import ByteTokenizer, build_dataloader
from dtrain.data.dataloader import build_sample_source
from dtrain.step.labels import IGNORE_INDEX

TOKENIZER = ByteTokenizer()
ANSWERS = ["4.", "six", "The answer is 10."]


def chats(count):
    """Conversations whose answers are ANSWERS in turn, some multi-turn."""
    rows = []
    for i in range(count):
        messages = [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": ANSWERS[i % 3]}]
        if i % 4 == 3:
            messages += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": ANSWERS[0]}]
        rows.append({"messages": messages})
    return rows


def training(tmp_path, rows, **overrides):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    t = JobConfig().training
    chat = replace(Chat(), **{k: v for k, v in overrides.items() if hasattr(Chat, k)})
    fields = {"attention_mask": "block_causal", **{k: v for k, v in overrides.items() if not hasattr(Chat, k)}}
    return replace(t, dataset="chat", dataset_path=str(path), seq_len=100, local_batch_size=2, chat=chat, **fields)


def batches(t, count, dp_rank=0, dp_size=1, background=None):
    loader = build_dataloader(replace(t, dataloader=background), TOKENIZER, dp_rank, dp_size, seed=0)
    out = [next(loader) for _ in range(count)]
    return loader, out


def answers_of(batch):
    """The text each row trains on (label bytes, EOS as '|')."""
    texts = []
    for labels in batch["labels"]:
        kept = labels[labels != IGNORE_INDEX].tolist()
        texts.append("".join("|" if i == TOKENIZER.eos_id else chr(i) for i in kept))
    return texts


def test_only_assistant_tokens_and_their_eos_are_labels(tmp_path):
    _, (batch,) = batches(training(tmp_path, chats(4)), 1)
    assert set(batch) == {"input_ids", "labels", "document_ids"}
    # Packed in windows of 101 tokens: conversations 0 and 1 (34 and 35 tokens), then 2 (50; 3 does not fit).
    assert answers_of(batch) == ["4.|six|", "The answer is 10.|"]
    labels, inputs = batch["labels"], batch["input_ids"]
    trained = labels != IGNORE_INDEX
    # A label is the next input token.
    assert torch.equal(labels[:, :-1][trained[:, :-1]], inputs[:, 1:][trained[:, :-1]])


def test_documents_are_explicit_and_padding_is_its_own(tmp_path):
    _, (batch,) = batches(training(tmp_path, chats(4)), 1)
    docs, inputs = batch["document_ids"][0], batch["input_ids"][0]
    starts = torch.nonzero(inputs == TOKENIZER.bos_id).flatten().tolist()
    assert starts[:2] == [0, starts[1]] and docs[starts[1]] == 1 and docs[starts[1] - 1] == 0
    padding = docs == docs[-1]
    assert docs[-1] == 2 and (inputs[padding] == TOKENIZER.eos_id).all()
    assert (batch["labels"][0][padding] == IGNORE_INDEX).all()


def test_unpacked_is_one_conversation_per_row(tmp_path):
    _, (batch,) = batches(training(tmp_path, chats(4), packed=False), 1)
    assert answers_of(batch) == ["4.|", "six|"]
    assert (batch["document_ids"] <= 1).all()


def test_train_on_input_trains_every_token_but_padding_and_document_starts(tmp_path):
    _, (batch,) = batches(training(tmp_path, chats(4), train_on_input=True, packed=False), 1)
    length = int((batch["document_ids"][0] == 0).sum())
    assert int((batch["labels"][0] != IGNORE_INDEX).sum()) == length - 1


def test_without_document_masking_batches_have_no_document_ids(tmp_path):
    _, (batch,) = batches(training(tmp_path, chats(4), attention_mask="causal"), 1)
    assert set(batch) == {"input_ids", "labels"}


@pytest.mark.parametrize(
    ("policy", "expected"), [("drop", "1 dropped and 0 truncated"), ("truncate", "0 dropped and 1 truncated")]
)
def test_overlong_conversations_are_counted_once_per_pass(tmp_path, caplog, policy, expected):
    rows = chats(3) + [{"messages": [{"role": "user", "content": "x" * 120}, {"role": "assistant", "content": "y"}]}]
    t = training(tmp_path, rows, overlong_policy=policy)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        batches(t, 4)
    lines = [r.message for r in caplog.records if "chat data, pass 0" in r.message]
    assert len(lines) == 1 and f"4 conversations, {expected} as longer than seq_len + 1 = 101" in lines[0]


def test_every_conversation_too_long_is_refused(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "x" * 120}, {"role": "assistant", "content": "y"}]}]
    with pytest.raises(Exception, match="no conversation has a trained token within seq_len"):
        batches(training(tmp_path, rows), 1)


@pytest.mark.parametrize("policy", ["drop", "truncate"])
def test_data_that_trains_nothing_is_refused_by_the_pre_flight(tmp_path, policy):
    """prepare (the pre-flight) refuses chat data of which no conversation trains within seq_len + 1 (too long to
    keep, or cut before its answer), before the run folder exists: not at the first batch, after config.toml,
    metrics.jsonl and tb/ are written."""
    from dtrain.errors import DataError
    from dtrain.run.prepare import prepare

    cfg = JobConfig()
    rows = [{"messages": [{"role": "user", "content": "x" * 120}, {"role": "assistant", "content": "y"}]}]
    cfg.training = training(tmp_path, rows, overlong_policy=policy)
    cfg.job.dump_folder = str(tmp_path / "run")
    with pytest.raises(DataError, match=r"no conversation has a trained token within seq_len \+ 1 = 101 tokens"):
        prepare(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("background", [None, DataLoaderConfig()])
def test_resume_continues_with_the_same_batches(tmp_path, background):
    """3 batches, a state, 4 more == 7 uninterrupted, across an epoch boundary; also with background loading."""
    t = training(tmp_path, chats(9))
    _, uninterrupted = batches(t, 7, background=background)
    loader, _ = batches(t, 3, background=background)
    state = loader.state_dict()
    resumed = build_dataloader(replace(t, dataloader=background), TOKENIZER, 0, 1, seed=0)
    resumed.load_state_dict(state)
    for expected in uninterrupted[3:]:
        got = next(resumed)
        assert all(torch.equal(got[key], expected[key]) for key in expected)
    assert resumed.state_dict()["epoch"] >= 1  # the run went past the end of the data


def test_data_parallel_ranks_split_the_global_batch(tmp_path):
    t = training(tmp_path, chats(9))
    _, (whole,) = batches(replace(t, local_batch_size=4), 1)
    halves = [batches(t, 1, dp_rank=rank, dp_size=2)[1][0] for rank in (0, 1)]
    for key in whole:
        assert torch.equal(torch.cat([half[key] for half in halves]), whole[key])


def test_validation_reads_the_bundled_held_out_file_and_counts_its_windows(tmp_path):
    t = replace(JobConfig().training, dataset="chat", seq_len=128)
    train = build_sample_source(t, TOKENIZER, seed=0)
    held_out = build_sample_source(t, TOKENIZER, seed=0, split="validation")
    assert "validation" in held_out.description and "validation" not in train.description
    windows = held_out.samples_per_pass()
    assert 0 < windows < 16
    whole_pass = held_out.take(windows + 1, 0, windows + 1)
    assert held_out.state_dict()["epoch"] == 1 and whole_pass.shape[1:] == (3, 129)


def test_chat_data_is_refused_in_a_mixture():
    from dtrain.config import validate_config
    from dtrain.errors import ConfigError

    cfg = JobConfig()
    cfg.training.dataset, cfg.training.dataset_mixture = "mixture", [["builtin", "0.5"], ["chat", "0.5"]]
    with pytest.raises(ConfigError, match="training.dataset_mixture cannot hold chat data"):
        validate_config(cfg)
    cfg.training.dataset, cfg.training.dataset_mixture = "chat", []
    validate_config(cfg)


def test_a_qwen3_tokenizer_folder_trains_on_its_answers_and_end_of_turn(tmp_path):
    """With a template and no BOS in it, the packed conversations are still told apart by their document ids."""
    from dtrain.data.hf_tokenizer import HFTokenizer
    from tests.data.chat_tokenizers import write_chat_tokenizer

    tokenizer = HFTokenizer(str(write_chat_tokenizer(tmp_path / "qwen3", "qwen3") / "tokenizer.json"))
    t = replace(training(tmp_path, chats(2)), seq_len=200, local_batch_size=1)
    loader = build_dataloader(replace(t, dataloader=None), tokenizer, 0, 1, seed=0)
    batch = next(loader)
    labels, documents = batch["labels"][0], batch["document_ids"][0]
    first_two = labels[(labels != IGNORE_INDEX) & (documents <= 1)]  # a third (the next pass's first) follows
    trained = tokenizer._tokenizer.decode(first_two.tolist(), skip_special_tokens=False)
    assert trained == "<think>\n\n</think>\n\n4.<|im_end|><think>\n\n</think>\n\nsix<|im_end|>"
    starts = torch.nonzero(batch["input_ids"][0] == tokenizer._tokenizer.token_to_id("<|im_start|>")).flatten()
    assert documents[starts].tolist()[:4] == [0, 0, 1, 1]


def test_samples_per_pass_counts_the_windows_of_one_pass(tmp_path):
    """Unpacked, one window per conversation; packed, the greedy count over the conversations' lengths (a window
    that would mix in the next pass's first conversation is not whole)."""
    from dtrain.data.chat_template import PlainChatTemplate

    rows = chats(9)
    assert build_sample_source(training(tmp_path, rows, packed=False), TOKENIZER, seed=0).samples_per_pass() == 9
    lengths = [len(PlainChatTemplate(TOKENIZER).tokenize(row["messages"], "")[0]) for row in rows]
    windows, filled = 1, 0
    for length in lengths:
        if filled + length > 101:
            windows, filled = windows + 1, 0
        filled += length
    whole = windows - (filled + lengths[0] <= 101)  # the last window takes the next pass's first conversation
    assert build_sample_source(training(tmp_path, rows), TOKENIZER, seed=0).samples_per_pass() == whole


@pytest.mark.parametrize("packed", [True, False])
def test_the_pass_line_says_how_full_the_sequences_are(tmp_path, caplog, packed):
    """Per sequence of the first pass: conversation, trained and padding tokens (what packing saves)."""
    with caplog.at_level(logging.INFO, logger="dtrain"):
        batches(training(tmp_path, chats(4), packed=packed), 4)  # 8 windows: into the second pass
    (line,) = [r.message for r in caplog.records if "chat data, pass 0" in r.message]
    found = re.search(r"(\d+) of their (\d+) tokens are trained; (\d+) sequences, each on average ([\d.]+) "
                      r"conversation tokens \((\d+)% full\), ([\d.]+) trained, ([\d.]+) padding", line)
    trained, tokens, windows = (int(found[i]) for i in (1, 2, 3))
    placed, full, trained_each, padding = (float(found[i]) for i in (4, 5, 6, 7))
    assert placed + padding == pytest.approx(101, abs=0.1) and full == round(100 * placed / 101)
    if packed:  # [0, 1], [2], [3 + the next pass's 0]: the last sequence is the pass's
        assert windows == 3 and placed * 3 > tokens
    else:
        assert windows == 4 and placed * 4 == pytest.approx(tokens, abs=0.2)
        assert trained_each * 4 == pytest.approx(trained, abs=0.2)
