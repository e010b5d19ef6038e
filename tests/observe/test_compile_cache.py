"""compile.cache: the key follows what shapes the graphs, files are written whole and checked before loading, and
a resumed run on a machine whose inductor cache is empty compiles from the saved artifacts (all cache hits)."""

import json
import logging

import pytest
import torch
import xxhash
from torch.compiler._cache import CacheInfo

from dtrain.config import JobConfig
from dtrain.observe.compile_cache import PortableCompileCache, cache_key, cache_root, graph_settings
from tests.e2e.run_train_helpers import FP32, run_train


def _key(**sections) -> str:
    cfg = JobConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cache_key(graph_settings(cfg, world_size=2))


def test_the_key_changes_with_the_graphs_and_not_with_the_schedule_or_the_data():
    base = _key()
    for same in ({"training": {"steps": 99}}, {"optimizer": {"lr": 0.5}}, {"training": {"dataset": "files"}},
                 {"compile": {"cache_dir": "/elsewhere", "trace_folder": "trace"}}, {"job": {"dump_folder": "x"}}):
        assert _key(**same) == base, same
    for other in ({"training": {"seq_len": 4096}}, {"parallelism": {"tensor_parallel_degree": 2}},
                  {"model": {"flavor": "8B"}}, {"compile": {"mode": "max-autotune-no-cudagraphs"}},
                  {"activation_checkpoint": {"mode": "full"}}, {"training": {"mixed_precision_param": "float32"}}):
        assert _key(**other) != base, other
    cfg = JobConfig()
    assert cache_key(graph_settings(cfg, 2)) != cache_key(graph_settings(cfg, 4))


def test_the_cache_lives_in_the_run_folder_unless_compile_cache_dir_says_otherwise(tmp_path):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path / "run")
    assert cache_root(cfg.compile, cfg.job.dump_folder) == tmp_path / "run" / "compile_cache"
    cfg.compile.cache_dir = str(tmp_path / "shared")
    assert cache_root(cfg.compile, cfg.job.dump_folder) == tmp_path / "shared"
    cfg.compile.cache_dir = "mine"
    assert cache_root(cfg.compile, cfg.job.dump_folder) == tmp_path / "run" / "mine"


def _artifacts(n: int, first: int = 0):
    info = CacheInfo()
    info.artifacts["inductor"].extend(f"k{i}" for i in range(first, first + n))
    return (b"artifacts" * (n + first + 1), info)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    return PortableCompileCache.for_run(graph_settings(cfg, 2), cfg.compile, cfg.job.dump_folder, rank=1)


def test_save_writes_the_artifacts_with_their_record_and_only_when_there_is_something_new(cache, monkeypatch):
    saved = [_artifacts(2)]
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: saved[0])
    cache.save(step=1)
    data = cache.data_file.read_bytes()
    assert data == saved[0][0] and cache.data_file.name == "rank1.bin"
    record = json.loads(cache.record_file.read_text())
    assert record == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data), "artifacts": {"inductor": 2},
                      "step": 1}
    assert not (cache.folder / "key.json").exists()  # rank 0 writes it
    cache.save(step=5)  # nothing new compiled since: the file stays as it was
    assert json.loads(cache.record_file.read_text())["step"] == 1
    saved[0] = _artifacts(3)
    cache.save(step=5)
    assert json.loads(cache.record_file.read_text())["artifacts"] == {"inductor": 3}
    saved[0] = _artifacts(3, first=1)  # as many, one of them new (say the model code changed): the file follows
    cache.save(step=6)
    assert json.loads(cache.record_file.read_text())["step"] == 6 and cache.data_file.read_bytes() == saved[0][0]
    assert sorted(p.name for p in cache.folder.iterdir()) == ["rank1.bin", "rank1.json"]  # no temporary left


def test_a_damaged_cache_is_named_and_skipped_never_loaded(cache, monkeypatch, caplog):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: _artifacts(2))
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or _artifacts(2)[1])
    cache.save(step=1)
    cache.data_file.write_bytes(b"Artifacts" + cache.data_file.read_bytes()[9:])  # same size, one byte changed
    with caplog.at_level(logging.INFO, logger="dtrain"):
        cache.load()
    assert loaded == [] and cache.loaded is None
    assert f"{cache.data_file} is damaged (its size or checksum differs from rank1.json); compiling afresh" in caplog.text
    cache.record_file.unlink()
    cache.load()
    assert loaded == [] and "without a readable rank1.json" in caplog.text


def test_a_sound_cache_is_loaded_and_reported(cache, monkeypatch, caplog):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: _artifacts(2))
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data) or _artifacts(2)[1])
    with caplog.at_level(logging.INFO, logger="dtrain"):
        cache.load()
        assert "nothing saved for this model and layout" in caplog.text and cache.loaded is None
        cache.save(step=1)
        cache.load()
    assert loaded == [cache.data_file.read_bytes()]
    assert cache.loaded == {"from": str(cache.data_file), "artifacts": {"inductor": 2}}
    assert f"compile cache: loaded 2 artifact(s) (inductor 2) from {cache.data_file}" in caplog.text


@pytest.mark.slow
def test_a_resumed_run_on_an_empty_inductor_cache_compiles_from_the_saved_artifacts(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "--model.args.n_layers", "2", "--model.args.dim", "64", "--model.args.n_heads", "4",
        "--model.args.n_kv_heads", "2", "--training.seq_len", "16", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", *FP32, "--compile.enable", "--compile.cache", "--job.dump_folder", str(run_dir),
        "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false",
    ]
    # Each run gets an inductor cache of its own: only the artifacts in the run folder can make the second hit.
    first = run_train(*args, "--training.steps", "2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor_1"))
    assert first.returncode == 0, first.stderr[-2000:]
    report = json.loads((run_dir / "compile_report.json").read_text())
    assert report["cache"]["fx_graph"]["hit"] == 0 and report["portable_cache"] is None
    (key_folder,) = (run_dir / "compile_cache").iterdir()
    saved = json.loads((key_folder / "rank0.json").read_text())
    assert saved["step"] == 1 and saved["artifacts"]["inductor"] > 0 and saved["artifacts"]["aot_autograd"] > 0
    assert json.loads((key_folder / "key.json").read_text())["world_size"] == 1

    second = run_train(*args, "--training.steps", "3", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor_2"))
    assert second.returncode == 0, second.stderr[-2000:]
    log = second.stdout + second.stderr
    assert f"compile cache: loaded {sum(saved['artifacts'].values())} artifact(s)" in log
    assert "compile cache: saved" not in log  # every artifact it hit is one the file holds: nothing to rewrite
    report = json.loads((run_dir / "compile_report.json").read_text())
    assert report["portable_cache"] == {"from": str(key_folder / "rank0.bin"), "artifacts": saved["artifacts"]}
    fx, aot = report["cache"]["fx_graph"], report["cache"]["aot_autograd"]
    assert fx["miss"] == 0 and fx["hit"] == saved["artifacts"]["inductor"]
    assert aot["miss"] == 0 and aot["hit"] == saved["artifacts"]["aot_autograd"]
