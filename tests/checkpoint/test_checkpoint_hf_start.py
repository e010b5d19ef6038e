"""Starting from a Hugging Face folder: its config.json decides the family and the shape (no flavor needed), a
contradicting setting is refused in one line, and run_train.sh trains a Qwen3 it was never told about."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from e2e_checkpoint_helpers import run_train

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import save_hf
from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.models.llama3 import LLAMA3_FLAVORS
from dtrain.models.qwen3 import QWEN3_FLAVORS
from dtrain.parallelize import get_family
from dtrain.run.prepare import prepare

# The byte tokenizer has 258 tokens; HF models made for these tests have 320 rows, as a run would round them.
HF_ARGS = {
    "qwen3": replace(QWEN3_FLAVORS["debugmodel"], n_layers=2, head_dim=32, hidden_dim=256, vocab_size=320),
    "llama3": replace(LLAMA3_FLAVORS["debugmodel_gqa"], n_layers=2, vocab_size=320),  # GQA: HF's k permutation
}


def write_hf(folder: Path, family: str = "qwen3", **changes) -> Path:
    """A Hugging Face folder (safetensors + config.json) of a small random model of `family`."""
    torch.manual_seed(0)
    args, model = replace(HF_ARGS[family], **changes), get_family(family).model
    save_hf(model_state_dict([model.model_cls(args)]), folder, model.hf_adapter(args), torch.float32)
    return folder


def start_from(folder: Path, *argv: str):
    flags = ["--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
             "--checkpoint.initial_load_model_only", *argv]
    cfg = load_config(flags)
    return cfg, prepare(cfg)


def test_config_json_decides_family_and_shape(tmp_path):
    cfg, prepared = start_from(write_hf(tmp_path / "hf"), "--training.seq_len", "4096")
    assert cfg.model.name == "qwen3" and prepared.family.name == "qwen3"
    args = prepared.model_args
    assert (args.n_layers, args.head_dim, args.hidden_dim, args.vocab_size) == (2, 32, 256, 320)
    assert args.max_seq_len == 4096  # the run's to choose
    assert cfg.model.args["head_dim"] == 32  # and the run's config.toml records it


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.args.n_layers", "3"], "model.args.n_layers=3 contradicts {src}, which has 2"),
        (["--model.tie_word_embeddings", "false"], "model.tie_word_embeddings=false contradicts {src}"),
        (["--model.name", "qwen3", "--model.args.head_dim", "64"], "model.args.head_dim=64 contradicts {src}"),
    ],
)
def test_a_contradicting_setting_is_refused_in_one_line(tmp_path, argv, message):
    folder = write_hf(tmp_path / "hf")
    with pytest.raises(ConfigError) as error:
        start_from(folder, *argv)
    assert message.format(src=folder / "config.json") in str(error.value)


def test_another_family_named_explicitly_is_refused(tmp_path):
    folder = write_hf(tmp_path / "hf", family="llama3")
    with pytest.raises(ConfigError, match="model.name=qwen3 contradicts .* a llama3 model"):
        start_from(folder, "--model.name", "qwen3")
    assert start_from(folder)[1].family.name == "llama3"


def test_unknown_architecture_and_small_vocabulary(tmp_path):
    folder = write_hf(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ConfigError, match="describes MistralForCausalLM, which no model family reads"):
        start_from(folder)
    small = write_hf(tmp_path / "small", vocab_size=128)
    with pytest.raises(ConfigError, match="has vocab_size 128, fewer than the tokenizer's 258 tokens"):
        start_from(small)


@pytest.mark.slow
def test_run_train_starts_a_qwen3_from_a_hf_folder_without_naming_it(tmp_path):
    folder, run_dir = write_hf(tmp_path / "hf"), tmp_path / "run"
    result = run_train(
        "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_model_only", "--training.steps", "1", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--job.dump_folder", str(run_dir),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"initial load from {folder}" in result.stderr + result.stdout
    written = (run_dir / "config.toml").read_text()
    assert 'name = "qwen3"' in written and "head_dim = 32" in written
