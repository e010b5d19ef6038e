"""Tokenizers: round trips for byte / Hugging Face / tiktoken, auto selection, and DataErrors that name the file."""

from __future__ import annotations

import json

import pytest

from dtrain.data import ByteTokenizer, build_tokenizer
from dtrain.data.hf_tokenizer import HFTokenizer
from dtrain.data.tiktoken_tokenizer import TiktokenTokenizer, llama3_special_tokens
from dtrain.errors import DataError

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "ünïcödé text survives the round trip ✓",
    "",
    "line one\nline two\t tabs  and  spaces",
]


def test_byte_tokenizer_round_trip_and_specials():
    tokenizer = ByteTokenizer()
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (258, 256, 257)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text
    # BOS/EOS are dropped on decode; a cut multi-byte character decodes to a replacement, not an exception.
    assert tokenizer.decode([256, *b"hi", 257]) == "hi"
    assert tokenizer.decode(list("é".encode())[:1]) == "\ufffd"


def test_hf_tokenizer_round_trip_and_llama3_specials(hf_tokenizer_dir):
    tokenizer = HFTokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    assert tokenizer.bos_id == 0 and tokenizer.eos_id == 1  # trained with these two special tokens first
    assert tokenizer.vocab_size == 300
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.bos_id not in ids and tokenizer.eos_id not in ids
        assert tokenizer.decode(ids) == text
    # BPE merges make common words shorter than their bytes.
    assert len(tokenizer.encode("the quick brown fox")) < len("the quick brown fox")
    assert tokenizer.decode([tokenizer.bos_id, *tokenizer.encode("hello"), tokenizer.eos_id]) == "hello"


def test_hf_tokenizer_prefers_tokenizer_config_specials(hf_tokenizer_dir):
    # tokenizer_config.json names EOS explicitly (as Llama 3 Instruct does with another token): it wins.
    (hf_tokenizer_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|begin_of_text|>"})
    )
    tokenizer = HFTokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    assert tokenizer.eos_id == tokenizer.bos_id == 0


def test_hf_tokenizer_without_bos_is_a_data_error(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=280, show_progress=False))
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    with pytest.raises(DataError, match="has no BOS token") as info:
        HFTokenizer(str(path))
    assert str(path) in str(info.value)


def test_tiktoken_round_trip_and_llama3_special_ids(tiktoken_dir):
    tokenizer = TiktokenTokenizer(str(tiktoken_dir / "tokenizer.model"))
    num_base = 256 + 5  # single bytes + the fixture's merges; Llama 3's file has 128000, so BOS = 128000 there
    assert (tokenizer.bos_id, tokenizer.eos_id) == (num_base, num_base + 1)
    assert tokenizer.vocab_size == num_base + 256
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert max(ids, default=0) < num_base
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("the") == [258]  # t+h -> th (256), th+e -> the (258)
    # Special-token text inside a document is plain text, never a control token.
    assert tokenizer.bos_id not in tokenizer.encode("<|begin_of_text|>")
    assert tokenizer.decode([tokenizer.bos_id, *tokenizer.encode("hello"), tokenizer.eos_id]) == "hello"


def test_llama3_special_token_table():
    names = llama3_special_tokens()
    assert len(names) == len(set(names)) == 256
    assert names[:2] == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert names[9] == "<|eot_id|>" and names[-1] == "<|reserved_special_token_247|>"


def test_auto_selection(make_config, hf_tokenizer_dir, tiktoken_dir):
    def auto(path):
        return build_tokenizer(make_config(**{"model.hf_assets_path": str(path)}).model)

    assert isinstance(build_tokenizer(make_config().model), ByteTokenizer)
    assert isinstance(auto(hf_tokenizer_dir), HFTokenizer)
    assert isinstance(auto(tiktoken_dir), TiktokenTokenizer)
    # tokenizer.json wins over tokenizer.model when a folder holds both; a file path selects by its name.
    (hf_tokenizer_dir / "tokenizer.model").write_bytes((tiktoken_dir / "tokenizer.model").read_bytes())
    assert isinstance(auto(hf_tokenizer_dir), HFTokenizer)
    assert isinstance(auto(hf_tokenizer_dir / "tokenizer.model"), TiktokenTokenizer)
    # An explicit kind overrides what the folder holds.
    forced = make_config(**{"model.hf_assets_path": str(hf_tokenizer_dir), "model.tokenizer": "tiktoken"})
    assert isinstance(build_tokenizer(forced.model), TiktokenTokenizer)
    assert isinstance(build_tokenizer(make_config(**{"model.tokenizer": "byte"}).model), ByteTokenizer)


@pytest.mark.parametrize("kind", ["auto", "hf", "tiktoken"])
def test_missing_tokenizer_files_are_data_errors(make_config, tmp_path, kind):
    for path in (tmp_path / "does_not_exist", tmp_path):
        cfg = make_config(**{"model.hf_assets_path": str(path), "model.tokenizer": kind})
        with pytest.raises(DataError, match="download_hf_assets.py") as info:
            build_tokenizer(cfg.model)
        assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_kind_without_assets_path_is_a_data_error(make_config):
    with pytest.raises(DataError, match="model.hf_assets_path"):
        build_tokenizer(make_config(**{"model.tokenizer": "hf"}).model)


def test_unloadable_files_are_data_errors(make_config, tmp_path):
    bad_json = tmp_path / "tokenizer.json"
    bad_json.write_text("{not json")
    with pytest.raises(DataError, match="cannot load Hugging Face tokenizer") as info:
        build_tokenizer(make_config(**{"model.hf_assets_path": str(bad_json)}).model)
    assert str(bad_json) in str(info.value)

    bad_ranks = tmp_path / "tokenizer.model"
    bad_ranks.write_text("aGk= 0\nthis line is not base64 and a rank\n")
    with pytest.raises(DataError, match="line 2") as info:
        build_tokenizer(make_config(**{"model.hf_assets_path": str(bad_ranks)}).model)
    assert str(bad_ranks) in str(info.value)
