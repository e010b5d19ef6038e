"""scripts/convert_checkpoint.py: a run's DCP checkpoint -> HF safetensors -> DCP again (bit-exact), and -> torch;
what it refuses before it writes anything (a config the checkpoint's record contradicts, an uncommitted checkpoint, an
output folder that holds something else), and how it writes."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat

import pytest
import torch
from checkpoint_helpers import REPO_ROOT, make_cfg, manager_for, tiny_state

from dtrain.checkpoint.dcp_io import read_full_weights
from dtrain.checkpoint.folders import COMMIT_FILE, read_record
from dtrain.config import to_toml
from dtrain.models.llama3 import Transformer
from dtrain.parallelize import get_family
from dtrain.run.prepare import model_args


def load_script():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO_ROOT / "scripts" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dcp_to_hf_and_back_is_bit_exact_and_to_torch_loads_without_pickle(run_dir, tmp_path, capsys):
    cfg = make_cfg(run_dir)
    cfg.model.flavor = "debugmodel_gqa"
    args = model_args(cfg, get_family("llama3").model, 258)
    torch.manual_seed(3)
    model = Transformer(args)
    manager_for(cfg, tiny_state(cfg, model=model), model_args=args).save(5)  # a full checkpoint, as a run writes it
    (run_dir / "config.toml").write_text(to_toml(cfg))
    convert = load_script()

    checkpoint, hf, back = run_dir / "checkpoint" / "step-5", tmp_path / "hf", tmp_path / "back"
    assert convert.main(["to-hf", str(checkpoint), str(hf), "--dtype", "float32"]) == 0
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    assert convert.main(["from-hf", str(hf), str(back)]) == 0
    assert read_record(back).model_only
    weights = read_full_weights(back)
    expected = model.state_dict()
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)

    assert convert.main(["to-torch", str(back), str(tmp_path / "model.pt")]) == 0
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(plain["layers.0.attention.wq.weight"], expected["layers.0.attention.wq.weight"])

    assert convert.main(["to-hf", str(back), str(tmp_path / "again")]) == 1  # no run config next to it
    assert "pass --config" in capsys.readouterr().err


@pytest.fixture
def saved_run(run_dir):
    """A tiny model's run folder with its config.toml and one full checkpoint, step-2 (saved, not trained)."""
    cfg = make_cfg(run_dir)
    cfg.model.args = {"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32}
    args = model_args(cfg, get_family("llama3").model, 258)
    manager_for(cfg, tiny_state(cfg, model=Transformer(args)), model_args=args).save(2)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return cfg, run_dir / "checkpoint" / "step-2"


def error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_a_config_that_contradicts_the_record_is_refused(saved_run, tmp_path, capsys):
    cfg, checkpoint = saved_run
    trained = read_record(checkpoint).model["args"]["rope_theta"]
    cfg.model.args["rope_theta"] = trained / 2  # every weight keeps its shape: only the record tells
    (tmp_path / "other.toml").write_text(to_toml(cfg))
    argv = [str(checkpoint), str(tmp_path / "hf"), "--config", str(tmp_path / "other.toml")]
    assert load_script().main(["to-hf", *argv]) == 1
    assert error_lines(capsys) == [
        f"error: --config {tmp_path / 'other.toml'} has model.args.rope_theta = {trained / 2!r}, but checkpoint "
        f"{checkpoint} records {trained!r} (what it was trained with): set model.args.rope_theta = {trained!r} there"
    ]
    assert not (tmp_path / "hf").exists()


def test_uncommitted_checkpoints_are_refused_and_foreign_ones_convert_with_one_warning(saved_run, tmp_path, capsys):
    _, checkpoint = saved_run
    partial = shutil.copytree(checkpoint, checkpoint.with_name("step-4.partial"))  # with its record, files intact
    convert = load_script()
    for command in ("to-hf", "to-torch", "to-peft"):
        assert convert.main([command, str(partial), str(tmp_path / "out")]) == 2, command
        assert error_lines(capsys) == [
            f"error: checkpoint {partial} is uncommitted (a save that never finished) and is never loaded; the "
            f"latest committed one is {checkpoint}"
        ]
    assert not (tmp_path / "out").exists()
    foreign = shutil.copytree(checkpoint, tmp_path / "run" / "checkpoint" / "foreign")
    (foreign / COMMIT_FILE).unlink()
    assert convert.main(["to-hf", str(foreign), str(tmp_path / "hf")]) == 0
    assert error_lines(capsys) == [
        f"warning: {foreign} has no {COMMIT_FILE}: a checkpoint from elsewhere, read without checksums"
    ]


def test_exports_replace_only_an_earlier_export_of_their_kind_with_the_users_umask(saved_run, tmp_path, capsys):
    _, checkpoint = saved_run
    convert, hf = load_script(), tmp_path / "hf"
    previous = os.umask(0o027)
    try:
        for _ in range(2):  # a new folder, then the earlier export replaced
            assert convert.main(["to-hf", str(checkpoint), str(hf)]) == 0, capsys.readouterr().err
    finally:
        os.umask(previous)
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left beside it
    assert {stat.S_IMODE(p.stat().st_mode) for p in hf.iterdir()} == {0o640}
    assert stat.S_IMODE(hf.stat().st_mode) == 0o750
    (hf / "tokenizer.json").write_text("{}")  # a model folder someone completed: not only an export any more
    for out, held in [(hf, "tokenizer.json"), (checkpoint, ".metadata")]:
        assert convert.main(["to-hf", str(checkpoint), str(out)]) == 2
        assert error_lines(capsys) == [
            f"error: output {out} is not empty and holds {held}, which to-hf does not write: name a new or empty "
            "folder (an earlier to-hf export there is replaced)"
        ]
    assert (hf / "tokenizer.json").is_file() and (checkpoint / COMMIT_FILE).is_file()
