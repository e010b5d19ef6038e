"""Fixtures of the data tests: configs and tiny tokenizer files written on the spot (nothing is downloaded)."""

from __future__ import annotations

import base64
import json

import pytest

from dtrain.config.schema import JobConfig

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokenizers",
    "packing documents into windows",
    "ünïcödé text survives the round trip ✓",
]


@pytest.fixture
def make_config():
    """A JobConfig with the given `section.field` overrides, e.g. make_config(**{"training.seq_len": 8})."""

    def make(**overrides) -> JobConfig:
        cfg = JobConfig()
        for dotted, value in overrides.items():
            section, name = dotted.split(".")
            assert hasattr(getattr(cfg, section), name), dotted
            setattr(getattr(cfg, section), name, value)
        return cfg

    return make


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    """A folder with a tokenizer.json: a byte-level BPE trained on CORPUS, with Llama 3's BOS/EOS names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    folder = tmp_path / "hf_tokenizer"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _write_tiktoken_ranks(path, merges=(b"th", b"he", b"the", b"ll", b"o ")) -> int:
    """A tiktoken ranks file: every single byte, then `merges`; returns the number of base tokens."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return len(tokens)


@pytest.fixture
def tiktoken_dir(tmp_path):
    """A folder with a tiny Llama 3 style tokenizer.model."""
    folder = tmp_path / "tiktoken"
    folder.mkdir()
    _write_tiktoken_ranks(folder / "tokenizer.model")
    return folder


@pytest.fixture
def write_jsonl():
    """Writes texts as JSON lines {field: text, "id": i} to a path."""

    def write(path, texts, field="text") -> None:
        path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")

    return write
