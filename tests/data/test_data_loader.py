"""Packing, data-parallel sharding, epochs and resume of the data loader."""

from __future__ import annotations

import pytest
import torch

from list_source import ListSource

from dtrain.data import ByteTokenizer, build_dataloader
from dtrain.data.dataloader import DataLoader
from dtrain.errors import DataError

DOCS = ["alpha", "", "bravo charlie", "delta echo foxtrot golf", "hotel", "india juliet kilo lima mike november"]


def reference_stream(docs, epochs=1):
    """The byte tokens the packer must produce: [BOS] bytes [EOS] per document, concatenated."""
    tokens = []
    for _ in range(epochs):
        for doc in docs:
            tokens += [256, *doc.encode(), 257]
    return torch.tensor(tokens)


def loader(seq_len=7, lbs=2, rank=0, dp=1, docs=DOCS, document_masking=False):
    return DataLoader(ListSource(docs), ByteTokenizer(), seq_len, lbs, rank, dp, document_masking=document_masking)


def windows_of(batch):
    """The seq_len + 1 token windows a batch was cut from."""
    return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)


def test_packing_windows_cover_the_stream_without_loss_or_overlap():
    data = loader(seq_len=7, lbs=2)
    batches = [next(data) for _ in range(4)]
    for batch in batches:
        assert batch["input_ids"].shape == batch["labels"].shape == (2, 7)
        assert batch["input_ids"].dtype == torch.long and batch["input_ids"].device.type == "cpu"
        assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])  # labels are inputs shifted by one
    emitted = torch.cat([windows_of(b).flatten() for b in batches])
    assert torch.equal(emitted, reference_stream(DOCS, epochs=2)[: len(emitted)])
    assert emitted[0] == 256


def test_epochs_repeat_the_corpus_and_are_counted():
    data = loader(seq_len=4, lbs=1)
    stream = reference_stream(DOCS, epochs=3)
    steps = len(stream) // 5
    emitted = torch.cat([windows_of(next(data)).flatten() for _ in range(steps)])
    assert torch.equal(emitted, stream[: steps * 5])
    assert data.state_dict()["epoch"] == 2 and data.state_dict()["sequences_consumed"] == steps


@pytest.mark.parametrize("dp_size", [2, 3])
def test_ranks_split_the_dp1_global_batch(dp_size):
    lbs = 2
    single = loader(seq_len=5, lbs=lbs * dp_size)
    ranks = [loader(seq_len=5, lbs=lbs, rank=r, dp=dp_size) for r in range(dp_size)]
    for _ in range(5):
        expected = next(single)
        parts = [next(r) for r in ranks]
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.cat([p[key] for p in parts]), expected[key])
    # The state is global: the same on every rank and equal to the single-rank run's.
    assert all(r.state_dict() == single.state_dict() for r in ranks)


def test_state_round_trip_gives_exactly_the_next_batch():
    data = loader(seq_len=6, lbs=2)
    for _ in range(3):
        next(data)
    state = data.state_dict()
    assert state["token_offset"] > 0  # resumes in the middle of a document, the interesting case
    expected = [next(data) for _ in range(4)]
    resumed = loader(seq_len=6, lbs=2)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    for batch in expected:
        got = next(resumed)
        assert torch.equal(got["input_ids"], batch["input_ids"]) and torch.equal(got["labels"], batch["labels"])


def test_resume_under_another_dp_size_continues_the_global_stream():
    seq_len, steps_before = 5, 3
    reference = loader(seq_len=seq_len, lbs=1)
    global_sequences = [windows_of(next(reference)) for _ in range(2 * 2 * steps_before + 4)]
    old = [loader(seq_len=seq_len, lbs=2, rank=r, dp=2) for r in range(2)]
    for _ in range(steps_before):
        for rank in old:
            next(rank)
    state = old[0].state_dict()
    assert state["sequences_consumed"] == 12
    new = [loader(seq_len=seq_len, lbs=1, rank=r, dp=4) for r in range(4)]
    for rank in new:
        rank.load_state_dict(state)
    resumed = torch.cat([windows_of(next(rank)) for rank in new])
    assert torch.equal(resumed, torch.cat(global_sequences[12:16]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_survives_a_dcp_save_and_load(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    data = loader(seq_len=6, lbs=2)
    next(data)
    dcp.save({"dataloader": data.state_dict()}, checkpoint_id=str(tmp_path))
    expected = next(data)
    resumed = loader(seq_len=6, lbs=2)
    state = {"dataloader": resumed.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(state["dataloader"])
    assert torch.equal(next(resumed)["input_ids"], expected["input_ids"])


def test_resume_does_not_reread_documents_before_the_position():
    class CountingSource(ListSource):
        starts = []

        def documents(self, start=0):
            self.starts.append(start)
            return super().documents(start)

    data = DataLoader(CountingSource(DOCS), ByteTokenizer(), 6, 1, 0, 1)
    for _ in range(5):
        next(data)
    state = data.state_dict()
    resumed = DataLoader(CountingSource(DOCS), ByteTokenizer(), 6, 1, 0, 1)
    resumed.load_state_dict(state)
    next(resumed)
    assert CountingSource.starts[-1] == state["document_position"] > 0


def test_changed_dataset_and_bad_state_are_data_errors():
    data = loader(seq_len=6, lbs=2)
    next(data)
    state = data.state_dict()
    shrunk = loader(seq_len=6, lbs=2, docs=["a"] * len(DOCS))
    shrunk.load_state_dict(state)
    with pytest.raises(DataError, match="changed since the checkpoint"):
        next(shrunk)
    with pytest.raises(DataError, match="lacks epoch"):
        loader().load_state_dict({"sequences_consumed": 1, "document_position": 0, "token_offset": 0})


def test_build_dataloader_synthetic_and_builtin(make_config):
    tokenizer = ByteTokenizer()

    def first_batch(cfg, dp_rank=0, dp_size=1):
        return next(build_dataloader(cfg.training, tokenizer, dp_rank, dp_size, seed=cfg.debug.seed))

    cfg = make_config(**{"training.dataset": "synthetic", "training.seq_len": 16, "training.local_batch_size": 3})
    batch = first_batch(cfg)
    assert batch["input_ids"].shape == (3, 16) and int(batch["input_ids"].max()) < tokenizer.vocab_size
    assert torch.equal(batch["input_ids"], first_batch(cfg)["input_ids"])
    cfg.debug.seed = 1
    assert not torch.equal(first_batch(cfg)["input_ids"], batch["input_ids"])

    cfg = make_config(**{"training.seq_len": 32, "training.local_batch_size": 2})
    assert first_batch(cfg, dp_rank=1, dp_size=2)["input_ids"].shape == (2, 32)


def test_empty_dataset_is_a_data_error_naming_the_path(make_config, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    cfg = make_config(**{"training.dataset": "files", "training.dataset_path": str(path)})
    with pytest.raises(DataError, match="holds no documents") as info:
        build_dataloader(cfg.training, ByteTokenizer(), 0, 1, seed=cfg.debug.seed)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("blank.jsonl", '{"text": ""}\n{"text": ""}\n')])
def test_a_dataset_of_empty_documents_is_a_data_error_not_bos_eos_training(make_config, tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    cfg = make_config(**{"training.dataset": "files", "training.dataset_path": str(path)})
    loader = build_dataloader(cfg.training, ByteTokenizer(), 0, 1, seed=cfg.debug.seed)
    with pytest.raises(DataError, match=f"training.dataset_path '{path}' holds no text \\(every document is empty\\)"):
        next(iter(loader))


def test_document_ids_count_a_new_document_at_every_bos():
    # Stream: BOS a b EOS | BOS EOS | BOS c d e EOS | BOS a b EOS ... (the second epoch), windows of 6 tokens:
    # inputs [BOS a b EOS BOS], [BOS c d e EOS], [a b EOS BOS EOS].
    data = loader(seq_len=5, lbs=1, docs=["ab", "", "cde"], document_masking=True)
    rows = [next(data)["document_ids"].tolist() for _ in range(3)]
    # Tokens before a window's first BOS finish a document begun in an earlier window: document 0.
    assert rows == [[[1, 1, 1, 1, 2]], [[1, 1, 1, 1, 1]], [[0, 0, 0, 1, 1]]]


def test_document_ids_follow_the_documents_of_the_stream():
    data = loader(seq_len=7, lbs=2, document_masking=True)
    stream = reference_stream(DOCS, epochs=2)
    document_of_token = (stream == 256).cumsum(0)  # each token's document in the whole stream, from 1
    for step in range(4):
        batch = next(data)
        assert batch["document_ids"].dtype == torch.long and batch["document_ids"].shape == (2, 7)
        for row in range(2):
            start = (2 * step + row) * 8
            documents = document_of_token[start : start + 7]
            first = documents[0] - (stream[start] == 256).long()  # the document begun before this window
            assert torch.equal(batch["document_ids"][row], documents - first)


def test_document_masking_leaves_the_tokens_and_the_state_unchanged():
    plain, masked = loader(seq_len=6, lbs=2), loader(seq_len=6, lbs=2, document_masking=True)
    for _ in range(3):
        expected, got = next(plain), next(masked)
        assert "document_ids" not in expected
        assert all(torch.equal(got[key], expected[key]) for key in ("input_ids", "labels"))
    assert masked.state_dict() == plain.state_dict()
    expected = next(masked)
    resumed = loader(seq_len=6, lbs=2, document_masking=True)
    resumed.load_state_dict(plain.state_dict())
    assert torch.equal(next(resumed)["document_ids"], expected["document_ids"])


def test_build_dataloader_adds_document_ids_for_block_causal(make_config):
    def first_batch(mask):
        cfg = make_config(**{"training.seq_len": 32, "training.local_batch_size": 2, "training.attention_mask": mask})
        return next(build_dataloader(cfg.training, ByteTokenizer(), 0, 1, seed=cfg.debug.seed))

    assert set(first_batch("causal")) == {"input_ids", "labels"}
    batch = first_batch("block_causal")
    assert torch.equal(batch["document_ids"], (batch["input_ids"] == ByteTokenizer.bos_id).cumsum(1))


def test_bad_rank_is_rejected():
    with pytest.raises(ValueError, match="dp_rank 2"):
        loader(rank=2, dp=2)
