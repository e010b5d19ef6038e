"""Pre-tokenized datasets (`training.dataset = "tokens"`): reading, the per-epoch order, per-rank work that shrinks
with dp, resume across dp, mixtures, validation, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from list_source import ListSource

from dtrain.config.schema import JobConfig
from dtrain.config.validate import validate_config
from dtrain.data import ByteTokenizer, build_dataloader
from dtrain.data.dataloader import DataLoader
from dtrain.data.samples import TokenSamples
from dtrain.data.token_shards import TokenShards
from dtrain.data.tokenize_corpus import tokenize_corpus
from dtrain.errors import ConfigError, DataError
from dtrain.run.validation import build_validator
from dtrain.step.state import RankCoordinates

# 40 documents of varied lengths: about 2,700 byte tokens with BOS/EOS.
DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7) for i in range(40)]
SEQ_LEN = 15  # windows of 16 tokens


def write_tokens(folder, docs=DOCS, shard_tokens=500, tokenizer=None):
    tokenize_corpus(ListSource(docs), {"path": "test", "kind": "files", "text_field": "text"},
                    tokenizer or ByteTokenizer(), str(folder), shard_tokens=shard_tokens)
    return folder


@pytest.fixture
def tokens_dir(tmp_path):
    return write_tokens(tmp_path / "tokens")


def stream(docs=DOCS):
    return torch.tensor([t for doc in docs for t in (256, *doc.encode(), 257)])


def samples(folder, shuffle_keys=None, seq_len=SEQ_LEN):
    return TokenSamples(TokenShards(str(folder), ByteTokenizer()), seq_len + 1, shuffle_keys)


def loader(folder, lbs=4, rank=0, dp=1, shuffle_keys=(0, "tokens", 0)):
    return DataLoader(samples(folder, shuffle_keys), ByteTokenizer(), SEQ_LEN, lbs, rank, dp)


def windows_of(batch):
    return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)


def test_reads_span_shards_and_equal_the_packers_stream(tokens_dir):
    shards = TokenShards(str(tokens_dir), ByteTokenizer())
    assert len(json.loads((tokens_dir / "manifest.json").read_text())["shards"]) > 3
    reference = stream()
    assert shards.num_tokens == len(reference) and shards.num_documents == len(DOCS)
    for start, count in [(0, 16), (490, 40), (0, len(reference)), (len(reference) - 3, 3)]:
        assert torch.equal(torch.from_numpy(shards.read(start, count)), reference[start : start + count])
    with pytest.raises(IndexError):
        shards.read(len(reference) - 2, 3)


def test_in_order_the_windows_are_the_packers_windows(tokens_dir):
    text = DataLoader(ListSource(DOCS), ByteTokenizer(), SEQ_LEN, 4, 0, 1)
    tokens = loader(tokens_dir, shuffle_keys=None)
    per_pass = len(stream()) // (SEQ_LEN + 1)
    for _ in range(per_pass // 4):  # the first epoch, where both cut the same stream
        a, b = next(text), next(tokens)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_each_epoch_is_a_new_order_of_the_same_windows_reproducible_by_seed(tokens_dir):
    per_pass = samples(tokens_dir).per_pass
    all_windows = stream()[: per_pass * 16].view(per_pass, 16)

    def epochs(seed, count=2):
        data = samples(tokens_dir, (seed, "tokens", 0))
        return [data.take(per_pass, 0, per_pass) for _ in range(count)]

    first, second = epochs(1)
    for epoch in (first, second):  # every window once per epoch
        assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, all_windows.tolist()))
    assert not torch.equal(first, second) and not torch.equal(first, all_windows)
    assert all(torch.equal(a, b) for a, b in zip(epochs(1), (first, second)))  # same seed, same order
    assert not torch.equal(epochs(2, 1)[0], first)  # another seed, another order


def test_a_rank_reads_only_its_own_samples_and_the_ranks_together_are_one_process(tokens_dir, monkeypatch):
    reads = []
    original = TokenShards.read
    monkeypatch.setattr(TokenShards, "read", lambda self, start, count: reads.append(count) or original(self, start, count))
    single = loader(tokens_dir, lbs=8)
    expected = [next(single)["input_ids"] for _ in range(30)]  # about 2 epochs
    assert len(reads) == 30 * 8
    reads.clear()
    ranks = [loader(tokens_dir, lbs=2, rank=r, dp=4) for r in range(4)]
    for step in range(15):
        assert torch.equal(torch.cat([next(r)["input_ids"] for r in ranks]), expected[step])
    assert len(reads) == 15 * 2 * 4  # each of the 4 ranks read its 2 windows per batch, no more
    state = ranks[0].state_dict()
    assert state == ranks[3].state_dict() and set(state) == {"sequences_consumed", "epoch", "epoch_sample"}
    resumed = loader(tokens_dir, lbs=8)  # dp 4 -> dp 1
    resumed.load_state_dict(state)
    for step in range(15, 30):
        assert torch.equal(next(resumed)["input_ids"], expected[step])


def test_a_mixture_of_a_tokens_dataset_and_a_text_source(tokens_dir, make_config):
    cfg = make_config(**{
        "training.dataset": "mixture", "training.seq_len": SEQ_LEN, "training.local_batch_size": 10,
        "training.dataset_mixture": [["tokens", str(tokens_dir), "4"], ["synthetic", "1"]],
    })
    validate_config(cfg)
    data = build_dataloader(cfg.training, ByteTokenizer(), 0, 1, seed=0)
    batches = [next(data)["input_ids"] for _ in range(10)]
    # 4 of every 5 samples are the dataset's: each one is a window of its stream.
    owners = data._batches.interleave.sources(0, 100).reshape(10, 10)
    windows = {tuple(w) for w in stream()[: (len(stream()) // 16) * 16].view(-1, 16)[:, :-1].tolist()}
    for batch, owner in zip(batches, owners):
        assert [tuple(row) in windows for row in batch.tolist()] == (owner == 0).tolist()
    assert (owners == 0).sum() == 80
    assert "mixture of 80.0% pre-tokenized dataset" in data.description
    state = data.state_dict()
    assert {"source0_epoch", "source0_epoch_sample", "source1_document_position"} <= set(state)
    again = build_dataloader(cfg.training, ByteTokenizer(), 0, 1, seed=0)
    again.load_state_dict(state)
    fresh = build_dataloader(cfg.training, ByteTokenizer(), 0, 1, seed=0)
    later = [next(fresh)["input_ids"] for _ in range(12)][10:]
    assert all(torch.equal(next(again)["input_ids"], b) for b in later)


def test_validation_reads_a_tokens_dataset_whole(tokens_dir):
    cfg = JobConfig()
    cfg.validation.enable = True
    cfg.validation.dataset, cfg.validation.dataset_path = "tokens", str(tokens_dir)
    cfg.validation.seq_len, cfg.validation.local_batch_size, cfg.validation.steps = SEQ_LEN, 2, -1
    per_pass = len(stream()) // (SEQ_LEN + 1)
    sections = (cfg.validation, cfg.training, cfg.debug.seed)
    assert build_validator(*sections, RankCoordinates(), ByteTokenizer(), "cpu").batches == per_pass // 2
    second_rank = RankCoordinates(dp_rank=1, dp_size=2)
    assert build_validator(*sections, second_rank, ByteTokenizer(), "cpu").batches == per_pass // 4


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_another_tokenizer_is_refused_naming_both(tokens_dir, hf_tokenizer_dir):
    from dtrain.data.hf_tokenizer import HFTokenizer

    with pytest.raises(DataError) as caught:
        TokenShards(str(tokens_dir), HFTokenizer(str(hf_tokenizer_dir / "tokenizer.json")))
    message = one_line(caught)
    assert "training.dataset_path" in message and "was tokenized by another tokenizer" in message
    assert "kind 'byte' vs 'hf'" in message


def test_damaged_or_unfinished_folders_are_refused(tokens_dir, tmp_path):
    with pytest.raises(DataError, match="has no manifest.json: not a pre-tokenized dataset") as caught:
        TokenShards(str(tmp_path), ByteTokenizer())
    one_line(caught)
    with pytest.raises(DataError, match="does not exist"):
        TokenShards(str(tmp_path / "nowhere"), ByteTokenizer())
    manifest_path = tokens_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    (tokens_dir / "shard_00001.tokens").write_bytes(b"\0" * 10)
    with pytest.raises(DataError, match="shard shard_00001.tokens is 10 bytes, its manifest says"):
        TokenShards(str(tokens_dir), ByteTokenizer())
    manifest_path.write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(DataError, match="is incomplete"):
        TokenShards(str(tokens_dir), ByteTokenizer())
    manifest_path.write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(DataError, match="format version 99"):
        TokenShards(str(tokens_dir), ByteTokenizer())


def test_an_id_outside_the_vocabulary_is_refused_before_the_model_sees_it(tokens_dir):
    # A damaged or foreign shard: one id (300) past the byte tokenizer's 258, inside shard 2.
    shard = tokens_dir / "shard_00002.tokens"
    ids = np.fromfile(shard, dtype="<u2")
    ids[7] = 300
    ids.tofile(shard)
    data = loader(tokens_dir, shuffle_keys=None)
    with pytest.raises(DataError) as caught:
        for _ in range(len(stream()) // (SEQ_LEN + 1)):
            next(data)
    message = one_line(caught)
    assert "shard shard_00002.tokens holds id 300 at token 7" in message
    assert "outside the tokenizer's vocabulary of 258" in message and "training.dataset_path" in message


def test_a_dataset_shorter_than_one_window_is_refused(tmp_path):
    folder = write_tokens(tmp_path / "short", docs=["hi"])
    with pytest.raises(DataError, match="fewer than 16 tokens"):
        samples(folder)


def test_a_saved_position_beyond_the_dataset_is_refused(tokens_dir):
    data = samples(tokens_dir)
    with pytest.raises(DataError, match="changed since the checkpoint"):
        data.load_state_dict({"epoch": 0, "epoch_sample": data.per_pass})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"training.dataset": "tokens"}, "training.dataset = tokens needs training.dataset_path"),
        ({"training.dataset_mixture": [["builtin", "1"]]},
         "training.dataset_mixture is set but training.dataset = builtin; set training.dataset = mixture"),
        ({"training.dataset": "mixture"}, "needs training.dataset_mixture"),
        ({"training.dataset": "mixture", "training.dataset_mixture": [["builtin", "1"]],
          "training.dataset_path": "/data"}, "training.dataset_path is not read with training.dataset = mixture"),
        ({"validation.enable": True, "validation.dataset": "mixture"}, "validation.dataset must be one of"),
        ({"validation.enable": True, "validation.dataset": "tokens"},
         "validation.dataset = tokens needs validation.dataset_path"),
    ],
)
def test_config_mistakes_are_one_line_errors(make_config, overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        validate_config(make_config(**overrides))
    one_line(caught)


def test_only_a_bounded_number_of_shards_stay_mapped(tmp_path, monkeypatch):
    import dtrain.data.token_shards as token_shards

    monkeypatch.setattr(token_shards, "MAX_OPEN_SHARDS", 3)
    folder = write_tokens(tmp_path / "many", shard_tokens=50)
    shards = TokenShards(str(folder), ByteTokenizer())
    assert len(json.loads((folder / "manifest.json").read_text())["shards"]) > 10
    reference = stream()
    for start in range(0, shards.num_tokens - 40, 37):
        assert torch.equal(torch.from_numpy(shards.read(start, 40)), reference[start : start + 40])
        assert len(shards._maps) <= 3
