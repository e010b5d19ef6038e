"""A run's config.toml rebuilds its model exactly: every field is recorded (structured ones, such as RoPE scaling,
as tables), a run started from a Hugging Face folder names no flavor, and what cannot be recorded or is missing is
refused in one line. Also from-hf's family from config.json and the special-token ids of an export."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
from test_transformers_roundtrip import BOS, CONFIGS, EOS, original_model, tool

from dtrain.checkpoint.dcp_io import read_tensor_shapes
from dtrain.checkpoint.hf_io import token_ids
from dtrain.config import load_config, to_toml
from dtrain.errors import ConfigError
from dtrain.parallelize import FAMILIES, get_family
from dtrain.run.hf_start import hf_start
from dtrain.run.model_args import UNRECORDED, base_args, shape_table, typed_overrides
from dtrain.run.prepare import model_args, prepare

FLAVORS = [(name, flavor) for name, spec in FAMILIES.items() for flavor in spec.model.flavors]


def reread(cfg, tmp_path):
    """`cfg` written as a run's config.toml and read back."""
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    return load_config(["--config", str(tmp_path / "config.toml")])


@pytest.mark.parametrize("family, flavor", FLAVORS)
def test_every_flavor_rebuilds_from_its_record_alone(tmp_path, family, flavor):
    model = get_family(family).model
    args = model.flavors[flavor]
    cfg = load_config(["--model.name", family])
    cfg.model.flavor, cfg.model.args = "", shape_table(args)
    again = reread(cfg, tmp_path)
    assert base_args(model, again.model.flavor, typed_overrides(model, again.model.args)) == args


@pytest.mark.parametrize("family", CONFIGS)
def test_a_run_from_a_hf_folder_records_no_flavor_and_rebuilds_its_model(tmp_path, family):
    hf = tmp_path / "hf"
    original_model(family, hf)
    cfg = load_config(["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf",
                       "--training.seq_len", "32", "--job.dump_folder", str(tmp_path / "run")])
    args = prepare(cfg).model_args
    again = reread(cfg, tmp_path)
    assert again.model.flavor == "" and again.model.name == get_family(cfg.model.name).name
    spec = get_family(again.model.name).model
    assert model_args(again, spec, 258) == args  # as to-hf and run_generate.sh rebuild it
    start = hf_start(again.checkpoint, again.model.name)
    assert model_args(again, spec, 258, start) == args  # as a resume, with the folder still there
    if family == "llama3":
        assert (args.rope_scaling.factor, args.rope_scaling.original_max_position_embeddings) == (8.0, 32)
    if family == "deepseek_v3":
        assert (args.q_lora_rank, args.rope_scaling.mscale_all_dim) == (24, 0.8)


def test_a_run_from_a_hf_folder_may_choose_what_config_json_does_not_decide(tmp_path):
    original_model("deepseek_v3", tmp_path / "hf")
    flags = ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf",
             "--job.dump_folder", str(tmp_path / "run")]
    cfg = load_config([*flags, "--model.args.moe_bias_update_speed", "0", "--model.args.max_seq_len", "128"])
    args = prepare(cfg).model_args
    assert (args.moe_bias_update_speed, args.max_seq_len) == (0.0, 128)
    with pytest.raises(ConfigError, match=r"model.args.q_lora_rank=8 contradicts .*config.json, which has 24"):
        prepare(load_config([*flags, "--model.args.q_lora_rank", "8"]))


LLAMA = get_family("llama3").model
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize(
    "flavor, table, message",
    [
        ("debugmodel", {"rope_scaling": {k: v for k, v in SCALING.items() if k != "high_freq_factor"}},
         r"model.args.rope_scaling lacks model.args.rope_scaling.high_freq_factor \(its table gives every field"),
        ("debugmodel", {"rope_scaling": {**SCALING, "fctor": 2.0}},
         r"unknown key model.args.rope_scaling.fctor \(did you mean model.args.rope_scaling.factor\?\)"),
        ("debugmodel", {"rope_scaling": {**SCALING, "factor": "eight"}},
         "model.args.rope_scaling.factor expects a number"),
        ("debugmodel", {"rope_scaling": "8"}, "model.args.rope_scaling expects a table of factor, low_freq_factor"),
        ("debugmodel", {"rope_scaling": UNRECORDED}, "model.args.rope_scaling was not recorded"),
        ("", {"dim": 64}, r"model.flavor is empty, so \[model.args\] must give every field; it lacks "
                          r"model.args.n_layers and \d+ more"),
        ("8B_typo", {}, "model.flavor '8B_typo' is not a llama3 flavor"),
    ],
)
def test_what_cannot_rebuild_the_model_is_refused_in_one_line(flavor, table, message):
    with pytest.raises(ConfigError, match=message) as error:
        base_args(LLAMA, flavor, typed_overrides(LLAMA, table))
    assert "\n" not in str(error.value)


def test_a_value_toml_cannot_hold_is_recorded_as_such_and_refused_on_rebuild(tmp_path):
    args = replace(LLAMA.flavors["debugmodel"], rope_scaling=[8.0, 1.0])  # no TOML form for this field's type
    cfg = load_config([])
    cfg.model.flavor, cfg.model.args = "", shape_table(args)
    again = reread(cfg, tmp_path)
    assert again.model.args["rope_scaling"] == UNRECORDED
    with pytest.raises(ConfigError, match="model.args.rope_scaling was not recorded"):
        typed_overrides(LLAMA, again.model.args)


def test_from_hf_reads_the_family_from_config_json(tmp_path):
    hf = tmp_path / "hf"
    original_model("qwen3_moe", hf)
    converted = tool(sys.executable, "scripts/convert_checkpoint.py", "from-hf", str(hf), str(tmp_path / "dcp"))
    assert converted.returncode == 0, converted.stderr[-2000:]
    # A Qwen3-MoE's experts, stacked: the family and shape came from config.json (the old default read llama3).
    assert "layers.1.moe.experts.w1" in read_tensor_shapes(tmp_path / "dcp")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    refused = tool(sys.executable, "scripts/convert_checkpoint.py", "from-hf", str(hf), str(tmp_path / "dcp2"))
    assert refused.returncode == 2
    assert refused.stderr.strip().startswith("error: ") and "\n" not in refused.stderr.strip()
    assert "describes MistralForCausalLM, which no model family reads (valid: LlamaForCausalLM" in refused.stderr
    # --family overrides config.json's architecture.
    named = tool(sys.executable, "scripts/convert_checkpoint.py", "from-hf", str(hf), str(tmp_path / "dcp3"),
                 "--family", "qwen3")
    assert named.returncode == 0, named.stderr[-2000:]


def test_exported_special_tokens_are_the_original_configs_else_the_tokenizers(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"eos_token_id": [EOS, 3], "bos_token_id": None}))
    cfg = load_config(["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"])
    assert token_ids(cfg.model, cfg.checkpoint) == {"bos_token_id": BOS, "eos_token_id": [EOS, 3]}
    assert token_ids(cfg.model, load_config([]).checkpoint) == {"bos_token_id": BOS, "eos_token_id": EOS}
