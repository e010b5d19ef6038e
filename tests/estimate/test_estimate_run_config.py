"""The estimator reads a run's config.toml as training does: one that names no flavor (a run started from a Hugging
Face folder records its whole shape in [model.args]) estimates the model the run trains, with or without the folder
and the tokenizer on this machine; what cannot rebuild the model is refused in one line naming model.flavor."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dtrain.config import load_config, to_toml
from dtrain.errors import ConfigError
from dtrain.estimate import estimate, load_hardware
from dtrain.parallelize import get_family
from dtrain.run.prepare import model_description, prepare

REPO = Path(__file__).resolve().parents[2]
CPU = load_hardware("cpu")
# Two layers, and a vocabulary that is no flavor's (320 rows for the byte tokenizer's 258 tokens).
SHAPES = {"llama3": dict(n_layers=2, vocab_size=320), "qwen3": dict(n_layers=2, vocab_size=320),
          # What its HF form can express: sigmoid routing, HF's latent and final norm eps.
          "deepseek_v3": dict(n_layers=2, vocab_size=320, moe_score_func="sigmoid", latent_norm_eps=1e-6,
                              final_norm_dtype_eps=False)}


def no_tokenizer(tmp_path: Path) -> list[str]:
    """Flags for a tokenizer that is not on this machine (planning a run before downloading it)."""
    return ["--model.tokenizer", "auto", "--model.hf_assets_path", str(tmp_path / "absent")]


def hf_folder(folder: Path, family: str) -> Path:
    """A Hugging Face folder holding only the config.json of a small `family` model (all the estimate reads)."""
    model = get_family(family).model
    args = replace(model.flavors["debugmodel"], **SHAPES[family])
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(model.hf_adapter(args).hf_config(torch.float32)))
    return folder


def run_config(tmp_path: Path, *flags: str):
    """The config.toml a run of `flags` writes into its folder (resolved by the trainer's own checks), and the
    model args it trains."""
    run = tmp_path / "run"
    cfg = load_config([*flags, "--training.seq_len", "64", "--job.dump_folder", str(run)])
    args = prepare(cfg).model_args
    run.mkdir()
    (run / "config.toml").write_text(to_toml(cfg))
    return run / "config.toml", args


def hf_started(tmp_path: Path, family: str):
    hf = hf_folder(tmp_path / "hf", family)
    toml, args = run_config(tmp_path, "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf",
                            "--checkpoint.initial_load_model_only")
    return hf, toml, args


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_a_hf_started_runs_config_estimates_the_model_it_trains(tmp_path, family):
    hf, toml, trained = hf_started(tmp_path, family)
    assert 'flavor = ""' in toml.read_text()
    result = estimate(load_config(["--config", str(toml)]), 2, CPU)
    assert result.model_args == trained
    assert result.description.startswith(f"{family} (from {hf}), 2 x cpu: ")
    # Without the folder the record alone rebuilds the same model; without the tokenizer too, the vocabulary
    # is the recorded one (a flavor's would be 2048).
    (hf / "config.json").unlink()
    alone = estimate(load_config(["--config", str(toml), *no_tokenizer(tmp_path)]), 2, CPU)
    assert alone.model_args == trained and trained.vocab_size == 320
    assert alone.notes == ["tokenizer not found at model.hf_assets_path: the model's own vocabulary (320)"]
    assert alone.stages[0].memory.params == result.stages[0].memory.params > 0


def test_without_the_tokenizer_a_hf_start_takes_config_jsons_vocabulary(tmp_path):
    hf = hf_folder(tmp_path / "hf", "qwen3")
    cfg = load_config(["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf",
                       "--checkpoint.initial_load_model_only", *no_tokenizer(tmp_path)])
    result = estimate(cfg, 1, CPU)
    assert (result.model_args.vocab_size, result.model_args.n_layers) == (320, 2)
    assert result.description.startswith(f"qwen3 (from {hf}), 1 x cpu: ")


def test_a_normal_runs_config_still_names_its_flavor(tmp_path):
    toml, trained = run_config(tmp_path, "--model.args.n_layers", "2")
    assert 'flavor = "debugmodel_gqa"' in toml.read_text()  # train_configs/debug_model.toml's
    result = estimate(load_config(["--config", str(toml)]), 1, CPU)
    assert result.model_args == trained and result.description.startswith("llama3 debugmodel_gqa, 1 x cpu: ")
    # Without the tokenizer: the recorded vocabulary (sized for the byte tokenizer); a config that is no run's
    # record takes its flavor's, as before.
    missing = estimate(load_config(["--config", str(toml), *no_tokenizer(tmp_path)]), 1, CPU)
    assert missing.model_args == trained and missing.notes[0].endswith("the model's own vocabulary (320)")
    flavor = estimate(load_config([*no_tokenizer(tmp_path), "--model.vocab_size_from_tokenizer", "false"]), 1, CPU)
    assert flavor.model_args.vocab_size == 2048 and flavor.notes[0].endswith("the model's own vocabulary (2048)")


@pytest.mark.parametrize("tokenizer", ["byte", "missing"])
def test_no_flavor_and_an_incomplete_shape_is_refused_in_one_line(tmp_path, tokenizer):
    cfg = load_config(no_tokenizer(tmp_path) if tokenizer == "missing" else [])
    cfg.model.flavor, cfg.model.args = "", {"dim": 64}
    with pytest.raises(ConfigError, match=r"^model.flavor is empty, so \[model.args\] must give every field; it "
                                          r"lacks model.args.n_layers and \d+ more$"):
        estimate(cfg, 1, CPU)


def test_the_script_estimates_a_hf_started_run_from_its_config_toml(tmp_path):
    hf, toml, trained = hf_started(tmp_path, "llama3")
    out = tmp_path / "e.json"
    result = subprocess.run(
        [sys.executable, "scripts/estimate.py", "--config", str(toml), "--world_size", "2", "--hardware", "cpu",
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"llama3 (from {hf}), 2 x cpu: dp_replicate 1, dp_shard 2")
    assert json.loads(out.read_text())["layout"].startswith(f"llama3 (from {hf})")


@pytest.mark.parametrize(
    "flavor, checkpoint, expected",
    [
        ("debugmodel", {}, "llama3 debugmodel"),
        ("", {"initial_load_path": "/models/x", "initial_load_in_hf": True}, "llama3 (from /models/x)"),
        ("", {"initial_load_path": "/ckpt/step-5"}, "llama3, shape as given by model.args"),
        ("", {}, "llama3, shape as given by model.args"),
    ],
)
def test_the_model_is_named_by_flavor_or_by_where_its_shape_comes_from(flavor, checkpoint, expected):
    """As the training log's "model ..." line and the estimate's first line name it."""
    cfg = load_config([])
    cfg.model.flavor = flavor
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    assert model_description(cfg.model, cfg.checkpoint) == expected
