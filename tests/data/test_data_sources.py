"""Document sources: builtin, files (txt / jsonl / json / parquet), Hugging Face (local), c4 and synthetic."""

from __future__ import annotations

import gzip
import json
import sys
from itertools import islice

import numpy as np
import pytest

from dtrain.data import build_source
from dtrain.data.sources import BuiltinSource, FilesSource, SyntheticSource
from dtrain.errors import DataError


def texts(source, start=0, limit=None):
    return [doc for _, doc in islice(source.documents(start), limit)]


def dataset(make_config, kind, path=None, **training):
    """build_source for training.dataset = kind at path, with more training.* fields."""
    overrides = {"training.dataset": kind, **{f"training.{k}": v for k, v in training.items()}}
    if path is not None:
        overrides["training.dataset_path"] = str(path)
    cfg = make_config(**overrides)
    return build_source(cfg.training, None, seed=cfg.debug.seed)


def assert_seeks(source):
    """documents(p) yields exactly the documents at positions >= p, for every position p of the source."""
    everything = list(source.documents(0))
    positions = [p for p, _ in everything]
    assert positions == sorted(set(positions))
    for index, (position, _) in enumerate(everything):
        assert list(source.documents(position)) == everything[index:]
    assert list(source.documents(positions[-1] + 1)) == []


def test_builtin_corpus_is_the_stdlib_and_deterministic():
    first, second = BuiltinSource(), BuiltinSource()
    assert first.files == second.files and len(first.files) > 100
    assert any(f.endswith("/os.py") for f in first.files)
    assert not any("site-packages" in f for f in first.files)
    head = texts(first, limit=5)
    assert head == texts(second, limit=5)
    assert all(isinstance(doc, str) for doc in head) and sum(map(len, head)) > 0


def test_builtin_skips_undecodable_files_and_seeks_by_file_index(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "b.py").write_text("b = 2\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "pkg" / "c.py").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / "pkg" / "d.py").write_text("d = 4\n")
    (tmp_path / "notes.txt").write_text("not python")
    source = BuiltinSource(root=str(tmp_path))
    assert list(source.documents(0)) == [(0, "a = 1\n"), (1, "b = 2\n"), (3, "d = 4\n")]
    assert texts(source, 2) == ["d = 4\n"]


def test_builtin_without_python_files_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path)):
        BuiltinSource(root=str(tmp_path))


def test_files_folder_mixes_formats_in_sorted_order(tmp_path, write_jsonl):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    (tmp_path / "b_sub").mkdir()
    (tmp_path / "a.txt").write_text("whole file\nis one document")
    write_jsonl(tmp_path / "b_sub" / "c.jsonl", ["j0", "j1"])
    (tmp_path / "b_sub" / "d.json").write_text('{"text": "k0"}\n\n{"text": null}\n{"text": "k3"}\n')
    pq.write_table(pa.table({"text": ["p0", "p1", "p2", None, "p4"]}), tmp_path / "e.parquet", row_group_size=2)
    (tmp_path / "ignored.csv").write_text("text\nnot read\n")
    source = FilesSource(str(tmp_path), "text")
    assert texts(source) == ["whole file\nis one document", "j0", "j1", "k0", "k3", "p0", "p1", "p2", "p4"]
    assert_seeks(source)


def test_files_single_file_and_text_field(tmp_path, write_jsonl):
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, ["x", "y"], field="content")
    assert texts(FilesSource(str(path), "content")) == ["x", "y"]
    with pytest.raises(DataError, match="no field 'text'.*dataset_text_field") as info:
        texts(FilesSource(str(path), "text"))
    assert str(path) in str(info.value)


def test_parquet_missing_column_is_a_data_error(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a"]}), path)
    with pytest.raises(DataError, match="no column 'text'.*body"):
        texts(FilesSource(str(path), "text"))


def test_files_errors_name_the_path(tmp_path):
    (tmp_path / "only.csv").write_text("text\n")
    with pytest.raises(DataError, match="holds no data files") as info:
        FilesSource(str(tmp_path), "text")
    assert str(tmp_path) in str(info.value)
    with pytest.raises(DataError, match="does not exist"):
        FilesSource(str(tmp_path / "missing"), "text")
    with pytest.raises(DataError, match="not a supported file"):
        FilesSource(str(tmp_path / "only.csv"), "text")
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{oops\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        texts(FilesSource(str(tmp_path / "broken.jsonl"), "text"))


def test_synthetic_is_seeded():
    a, b, other = SyntheticSource(3, 50, 8), SyntheticSource(3, 50, 8), SyntheticSource(4, 50, 8)
    first = texts(a, limit=20)
    assert all(np.array_equal(x, y) for x, y in zip(first, texts(b, limit=20)))
    assert not all(np.array_equal(x, y) for x, y in zip(first, texts(other, limit=20)))
    assert all(1 <= len(doc) <= 16 and doc.min() >= 0 and doc.max() < 50 for doc in first)
    assert len({len(doc) for doc in first}) > 1
    position, doc = next(a.documents(7))
    assert position == 7 and np.array_equal(doc, first[7])


@pytest.fixture
def hf_datasets():
    return pytest.importorskip("datasets")


def test_hf_save_to_disk_dataset_and_dataset_dict(make_config, tmp_path, hf_datasets):
    rows = {"text": ["d0", "d1", None, "d3"], "other": [0, 1, 2, 3]}
    hf_datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "single"))
    hf_datasets.DatasetDict({"train": hf_datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dict"))
    for folder in ("single", "dict"):
        source = dataset(make_config, "hf", tmp_path / folder)
        assert list(source.documents(0)) == [(0, "d0"), (1, "d1"), (3, "d3")]
        assert_seeks(source)
    with pytest.raises(DataError, match="no column 'body'"):
        dataset(make_config, "hf", tmp_path / "single", dataset_text_field="body")


def _write_c4_like_shards(folder, docs_per_shard):
    (folder / "en").mkdir(parents=True)
    for shard, docs in enumerate(docs_per_shard):
        with gzip.open(folder / "en" / f"c4-train.{shard:05d}-of-01024.json.gz", "wt") as f:
            f.writelines(json.dumps({"text": d, "url": "u"}) + "\n" for d in docs)


def test_c4_reads_the_download_script_layout_streaming(make_config, tmp_path, hf_datasets):
    _write_c4_like_shards(tmp_path / "c4", [["a0", "a1"], ["b0"]])
    source = dataset(make_config, "c4", tmp_path / "c4")
    assert texts(source) == ["a0", "a1", "b0"]
    assert texts(source, 2) == ["b0"]


def test_c4_default_path_and_missing_paths(make_config, tmp_path, monkeypatch, hf_datasets):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"assets/datasets/c4.*download_hf_assets.py --dataset c4"):
        dataset(make_config, "c4")
    _write_c4_like_shards(tmp_path / "assets" / "datasets" / "c4", [["only"]])
    assert texts(dataset(make_config, "c4")) == ["only"]
    with pytest.raises(DataError, match="nowhere.*does not exist"):
        dataset(make_config, "hf", "nowhere")


def test_hf_single_data_file_streams(make_config, tmp_path, write_jsonl, hf_datasets):
    write_jsonl(tmp_path / "docs.jsonl", ["s0", "s1", "s2"])
    source = dataset(make_config, "hf", tmp_path / "docs.jsonl")
    assert list(source.documents(1)) == [(1, "s1"), (2, "s2")]


def test_hf_without_datasets_package_says_what_to_install(make_config, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError, match=r"pip install 'dtrain\[hf\]'"):
        dataset(make_config, "hf", tmp_path)
