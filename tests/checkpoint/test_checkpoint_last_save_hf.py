"""checkpoint.last_save_in_hf: the final save is a Hugging Face folder (safetensors + config.json) that the repo's HF
loader reads back to the same weights, that a finished run resumes from and a new run starts from; and
checkpoint.export_dtype = float16 for model-only and HF saves."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_helpers import FAMILY_ARGS, make_cfg, manager_for, tiny_model, tiny_state, train
from safetensors import safe_open

from dtrain.checkpoint import check_checkpoint_config
from dtrain.checkpoint.folders import DamagedCheckpoint, read_record
from dtrain.checkpoint.hf_io import build_adapter, load_hf_weights
from dtrain.config import load_config
from dtrain.errors import ConfigError
from dtrain.run.prepare import prepare


def train_to_the_end(cfg):
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, cfg.training.steps, cfg)
    manager.close()
    return state


def assert_same_weights(model, expected, dtype=torch.float32):
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name].to(dtype).float()), name


@pytest.mark.parametrize("family", ["llama3", "qwen3"])  # qwen3's debug model ties the head to the embedding
def test_final_save_is_a_hugging_face_folder_that_loads_back(run_dir, family):
    cfg = make_cfg(run_dir, steps=3, family=family, last_save_in_hf=True)
    state = train_to_the_end(cfg)
    final = run_dir / "checkpoint" / "step-3"
    assert sorted(p.name for p in final.iterdir()) == ["config.json", "dtrain_commit.json", "model.safetensors"]
    record = read_record(final)
    assert (record.kind, record.dtype, record.step, record.model_only) == ("hf", "float32", 3, True)
    assert read_record(run_dir / "checkpoint" / "step-2").kind == "full"  # interval saves stay DCP

    model = tiny_model(family)
    load_hf_weights([model], final, build_adapter(family, FAMILY_ARGS[family]))
    assert_same_weights(model, state.model_parts[0].state_dict())


def test_a_finished_hf_run_resumes_and_a_new_run_starts_from_it(run_dir, tmp_path):
    cfg = make_cfg(run_dir, steps=2, last_save_in_hf=True)
    trained = train_to_the_end(cfg).model_parts[0].state_dict()
    final = run_dir / "checkpoint" / "step-2"

    again = tiny_state(cfg)
    startup = manager_for(cfg, again).restore_at_startup()
    assert (startup.rule, startup.step, startup.model_only) == ("resume", 2, True)
    assert_same_weights(again.model_parts[0], trained)

    # Named by its folder (the commit record says safetensors) or with initial_load_in_hf, as any HF folder.
    for in_hf in (False, True):
        new = make_cfg(tmp_path / f"new-{in_hf}", initial_load_path=str(final), initial_load_in_hf=in_hf)
        fresh = tiny_state(new)
        assert manager_for(new, fresh).restore_at_startup().rule == "initial_load"
        assert_same_weights(fresh.model_parts[0], trained)


def test_a_damaged_hf_file_is_recognised(run_dir):
    cfg = make_cfg(run_dir, steps=1, last_save_in_hf=True)
    train_to_the_end(cfg)
    final = run_dir / "checkpoint" / "step-1"
    weights = final / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpoint, match="model.safetensors differs from what was committed"):
        read_record(final)


def test_float16_export_of_hf_and_model_only_saves(run_dir, tmp_path):
    cfg = make_cfg(run_dir, steps=1, last_save_in_hf=True, export_dtype="float16")
    trained = train_to_the_end(cfg).model_parts[0].state_dict()
    final = run_dir / "checkpoint" / "step-1"
    assert read_record(final).dtype == "float16"
    assert json.loads((final / "config.json").read_text())["torch_dtype"] == "float16"
    with safe_open(str(final / "model.safetensors"), framework="pt") as handle:
        assert {handle.get_tensor(name).dtype for name in handle.keys()} == {torch.float16}
    model = tiny_model()
    load_hf_weights([model], final, build_adapter("llama3", FAMILY_ARGS["llama3"]))
    assert_same_weights(model, trained, torch.float16)

    dcp_cfg = make_cfg(tmp_path / "dcp", steps=1, export_dtype="float16")
    trained = train_to_the_end(dcp_cfg).model_parts[0].state_dict()
    dcp_final = tmp_path / "dcp" / "checkpoint" / "step-1"
    assert (read_record(dcp_final).kind, read_record(dcp_final).dtype) == ("model_only", "float16")
    new = make_cfg(tmp_path / "new", initial_load_path=str(dcp_final))
    fresh = tiny_state(new)
    manager_for(new, fresh).restore_at_startup()
    assert_same_weights(fresh.model_parts[0], trained, torch.float16)


def test_hf_last_save_needs_model_only(tmp_path):
    cfg = make_cfg(tmp_path, last_save_in_hf=True, last_save_model_only=False)
    with pytest.raises(ConfigError, match=r"^checkpoint.last_save_in_hf saves the weights only; set "
                                          r"checkpoint.last_save_model_only = true"):
        check_checkpoint_config(cfg.checkpoint, cfg.optimizer.name, 1)


def test_a_last_save_hf_cannot_express_is_refused_before_the_run(tmp_path):
    # torchtitan's DeepSeek-V3 debugmodel takes eps 1e-5 in its latent norms (Hugging Face's model fixes them at
    # 1e-6); routed by sigmoid here so that the eps is what stands in the way.
    argv = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.args.moe_score_func", "sigmoid",
            "--checkpoint.enable", "--checkpoint.last_save_in_hf",
            "--checkpoint.last_save_model_only", "--job.dump_folder", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=r"^checkpoint.last_save_in_hf: .*latent_norm_eps") as error:
        prepare(load_config(argv, env={}))
    assert "\n" not in str(error.value) and not (tmp_path / "run").exists()
    assert prepare(load_config([*argv, "--model.args.latent_norm_eps", "1e-6", "--model.args.final_norm_dtype_eps",
                                "false"], env={}))
