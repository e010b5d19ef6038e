"""scripts/convert_checkpoint.py: a run's DCP checkpoint -> HF safetensors -> DCP again (bit-exact), and -> torch."""

from __future__ import annotations

import importlib.util

import torch
from checkpoint_helpers import REPO_ROOT, make_cfg, manager_for, tiny_state

from dtrain.checkpoint.dcp_io import read_full_weights
from dtrain.checkpoint.folders import read_record
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
    manager_for(cfg, tiny_state(cfg, model=model)).save(5)  # a full checkpoint, as a run writes it
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
