"""torchtitan's C4 names: c4, c4_test and c4_validation read one local C4 copy, or say how to download it."""

from __future__ import annotations

import gzip
import json

import pytest

from dtrain.config.reference import config_fields
from dtrain.data import build_source
from dtrain.data.hf_source import C4_KINDS, C4_TEST_DOCUMENTS
from dtrain.data.source_factory import C4_NAMES
from dtrain.errors import DataError


@pytest.fixture(autouse=True)
def hf_datasets():
    return pytest.importorskip("datasets")


def write_shard(folder, split, docs, shard=0):
    """One allenai/c4 English shard of `split`, named as scripts/download_hf_assets.py stores it."""
    (folder / "en").mkdir(parents=True, exist_ok=True)
    total = 1024 if split == "train" else 8
    with gzip.open(folder / "en" / f"c4-{split}.{shard:05d}-of-{total:05d}.json.gz", "wt") as f:
        f.writelines(json.dumps({"text": d, "timestamp": "t", "url": "u"}) + "\n" for d in docs)


def source(make_config, kind, path=None, split="train"):
    overrides = {"training.dataset": kind}
    if path is not None:
        overrides["training.dataset_path"] = str(path)
    cfg = make_config(**overrides)
    return build_source(cfg.training, None, seed=0, split=split)


def texts(src, start=0):
    return [doc for _, doc in src.documents(start)]


def test_the_names_are_training_dataset_choices():
    assert set(C4_KINDS) == set(C4_NAMES)
    assert set(C4_NAMES) <= set(config_fields()["training.dataset"].choices)


def test_c4_test_is_the_first_2000_training_documents(make_config, tmp_path):
    write_shard(tmp_path, "train", [f"t{i}" for i in range(1500)])
    write_shard(tmp_path, "train", [f"u{i}" for i in range(600)], shard=1)
    write_shard(tmp_path, "validation", ["v0"])
    c4_test = source(make_config, "c4_test", tmp_path)
    documents = texts(c4_test)
    assert C4_TEST_DOCUMENTS == 2000 and len(documents) == 2000
    assert documents[:2] == ["t0", "t1"] and documents[-1] == "u499"
    assert list(c4_test.documents(1999)) == [(1999, "u499")] and texts(c4_test, 2000) == []
    assert "first 2000 documents of C4's train split" in c4_test.description
    assert len(texts(source(make_config, "c4", tmp_path))) == 2100  # c4 reads them all


def test_c4_validation_reads_the_validation_split_only(make_config, tmp_path):
    write_shard(tmp_path, "train", ["t0", "t1"])
    write_shard(tmp_path, "validation", ["v0", "v1", "v2"])
    for split in ("train", "validation"):  # its name says which split, whatever the caller asks
        c4_validation = source(make_config, "c4_validation", tmp_path, split=split)
        assert texts(c4_validation) == ["v0", "v1", "v2"] and texts(c4_validation, 2) == ["v2"]
    assert texts(source(make_config, "c4", tmp_path)) == ["t0", "t1"]


def test_c4_validation_of_a_saved_dataset_dict(make_config, tmp_path, hf_datasets):
    splits = {name: hf_datasets.Dataset.from_dict({"text": [f"{name}0"]}) for name in ("train", "validation")}
    hf_datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved"))
    assert texts(source(make_config, "c4_validation", tmp_path / "saved")) == ["validation0"]
    assert texts(source(make_config, "c4_test", tmp_path / "saved")) == ["train0"]


@pytest.mark.parametrize(
    "kind, command",
    [
        ("c4", "--dataset c4 --num_shards 1"),
        ("c4_test", "--dataset c4 --num_shards 1"),
        ("c4_validation", "--dataset c4 --split validation --num_shards 1"),
    ],
)
def test_a_missing_local_copy_gives_the_download_command(make_config, tmp_path, monkeypatch, kind, command):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        source(make_config, kind)  # the default path, ./assets/datasets/c4
    message = str(info.value)
    assert f"python scripts/download_hf_assets.py {command} --local_dir ./assets/datasets/c4" in message
    absolute = tmp_path / "assets" / "datasets" / "c4"  # named absolute: a relative path is the launch folder's
    assert message.startswith(f"training.dataset_path './assets/datasets/c4' ({absolute}) does not exist")
    assert "\n" not in message


def test_a_copy_without_the_validation_shards_says_how_to_fetch_them(make_config, tmp_path):
    write_shard(tmp_path, "train", ["t0"])
    with pytest.raises(DataError) as info:
        texts(source(make_config, "c4_validation", tmp_path))
    message = str(info.value)
    assert "validation" in message and "--dataset c4 --split validation --num_shards 1" in message
    assert "\n" not in message
