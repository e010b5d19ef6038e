"""Hugging Face tokenizer folders whose special tokens live in tokenizer_config.json (torchtitan's test tokenizer).

The fixture has the structure of torchtitan v0.2.2's tests/assets/tokenizer: a byte-level BPE tokenizer.json with no
added tokens, and a tokenizer_config.json whose added_tokens_decoder declares BOS/EOS at ids the vocabulary does not
reach (128000, 128001) plus a token the vocabulary has (<|pad|>).
"""

from __future__ import annotations

import json
import logging

import pytest

from dtrain.data import build_tokenizer
from dtrain.data.hf_tokenizer import HFTokenizer
from dtrain.errors import DataError

MERGES = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"]]


def added_token(content):
    return {
        "content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": True,
    }


def write_tokenizer_json(folder, added_tokens=()):
    """A byte-level BPE tokenizer.json: the 256 byte symbols, three merges, then <|pad|> (260 ids), and
    `added_tokens` at ids 260, 261, ...; returns its vocab."""
    from tokenizers import pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for first, second in MERGES:
        vocab[first + second] = len(vocab)
    vocab["<|pad|>"] = len(vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": len(vocab) + i, **added_token(c)} for i, c in enumerate(added_tokens)],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": MERGES,
        },
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return vocab


@pytest.fixture
def titan_style_dir(tmp_path):
    """tokenizer.json without special tokens + tokenizer_config.json declaring them (as torchtitan's test asset)."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    vocab = write_tokenizer_json(folder)
    config = {
        "added_tokens_decoder": {
            "128000": added_token("<|begin_of_text|>"),
            "128001": added_token("<|end_of_text|>"),
            str(vocab["<|pad|>"]): added_token("<|pad|>"),
        },
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"__type": "AddedToken", **added_token("<|end_of_text|>")},
        "pad_token": "<|pad|>",
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_bos_eos_come_from_tokenizer_config_at_the_next_free_ids(titan_style_dir, make_config, caplog):
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        tokenizer = build_tokenizer(make_config(**{"model.hf_assets_path": str(titan_style_dir)}).model)
    assert isinstance(tokenizer, HFTokenizer)
    # 256 bytes + 3 merges + <|pad|> = 260 ids: BOS and EOS (declared 128000/128001) are appended, in id order.
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (260, 261, 262)
    assert "<|begin_of_text|> 128000 -> 260" in caplog.text  # the declared ids are not the ids: said once
    ids = tokenizer.encode("the cat")
    assert tokenizer.bos_id not in ids and max(ids) < 260
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id]) == "the cat"


def test_ids_and_encodings_match_transformers(titan_style_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(titan_style_dir))
    tokenizer = HFTokenizer(str(titan_style_dir / "tokenizer.json"))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (reference.bos_token_id, reference.eos_token_id)
    assert tokenizer.vocab_size == len(reference)
    text = "the theme<|pad|> <|end_of_text|>"
    assert tokenizer.encode(text) == reference(text, add_special_tokens=False)["input_ids"]


def test_special_tokens_already_in_tokenizer_json_keep_their_ids(tmp_path, caplog):
    # Llama 3's layout: tokenizer.json lists BOS/EOS as added tokens at the ids the config declares.
    write_tokenizer_json(tmp_path, added_tokens=["<|begin_of_text|>", "<|end_of_text|>"])
    config = {
        "added_tokens_decoder": {"260": added_token("<|begin_of_text|>"), "261": added_token("<|end_of_text|>")},
        "bos_token": {"content": "<|begin_of_text|>"},
        "eos_token": "<|end_of_text|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        tokenizer = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (260, 261, 262) and not caplog.text


def test_without_config_the_known_names_are_used(tmp_path):
    write_tokenizer_json(tmp_path, added_tokens=["<s>", "</s>"])
    tokenizer = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert (tokenizer.bos_id, tokenizer.eos_id) == (260, 261)


@pytest.mark.parametrize(
    "config, message",
    [
        ("{not json", "cannot read .*tokenizer_config.json.*fix it or remove it"),
        ("[1, 2]", "tokenizer_config.json' must hold a JSON object"),
        (json.dumps({"bos_token": 5}), "bos_token must be a string or an AddedToken dict"),
        (json.dumps({"added_tokens_decoder": {"7": {"special": True}}}), r"decoder\['7'\] has no 'content'"),
        (json.dumps({"added_tokens_decoder": {"bos": added_token("<s>")}}), "must map a token id to an AddedToken"),
    ],
)
def test_a_bad_tokenizer_config_is_a_data_error_naming_the_file(tmp_path, config, message):
    write_tokenizer_json(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(config)
    with pytest.raises(DataError, match=message) as info:
        HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert str(tmp_path / "tokenizer_config.json") in str(info.value) and "\n" not in str(info.value)
