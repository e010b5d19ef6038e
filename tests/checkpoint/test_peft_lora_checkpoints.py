"""A LoRA run that starts from a base model saves adapter-only checkpoints (the adapters, their optimizer state and
a reference to the base), resumes them exactly, and refuses one whose base is gone or changed; it can start its
adapters from a PEFT folder (lora.initial_adapter_path)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import TINY_ARGS, make_cfg, tiny_model, tiny_state, train
from peft_helpers import ATTENTION_AND_MLP, lora_model, save_base_hf

from dtrain.checkpoint import CheckpointManager, dcp_io
from dtrain.checkpoint.export_folder import export_mark
from dtrain.checkpoint.folders import read_record
from dtrain.checkpoint.hf_io import build_adapter
from dtrain.checkpoint.peft_export import save_peft_adapter
from dtrain.checkpoint.peft_names import is_lora
from dtrain.data import build_tokenizer
from dtrain.errors import DtrainError
from dtrain.precision.lora import apply_lora, init_lora_weights
from dtrain.run.prepare import model_args, model_family
from dtrain.step.rng import seed_everything


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    torch.manual_seed(5)
    return save_base_hf(tiny_model("llama3"), "llama3", tmp_path_factory.mktemp("base") / "hf")


def lora_cfg(run_dir, base_dir, **lora):
    cfg = make_cfg(run_dir, steps=6, initial_load_path=str(base_dir), initial_load_in_hf=True,
                   initial_load_model_only=True)
    cfg.lora.enable = True
    cfg.lora.target_modules = list(ATTENTION_AND_MLP)
    for key, value in lora.items():
        setattr(cfg.lora, key, value)
    return cfg


@functools.cache
def base_args(base_dir: str):
    """The model args the trainer resolves from the base's config.json, which a run's checkpoints record: the tiny
    model's, as config.json spells them (cached: a test may take the base away later)."""
    cfg = lora_cfg(Path(base_dir), base_dir)
    family, hf = model_family(cfg)
    return model_args(cfg, family.model, build_tokenizer(cfg.model).vocab_size, hf)


def start(cfg):
    """A LoRA run's state as the trainer builds it, restored by its CheckpointManager."""
    seed_everything(cfg.debug.seed, "init")
    model = tiny_model("llama3")
    apply_lora(model, cfg.lora)
    init_lora_weights(model, cfg.debug.seed)
    state = tiny_state(cfg, model=model)
    manager = CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, 0, 1, state, training=cfg.training, parallelism=cfg.parallelism,
        model=cfg.model, optimizer=cfg.optimizer, model_args=base_args(cfg.checkpoint.initial_load_path), lora=cfg.lora,
    )
    manager.restore_at_startup()
    return state, manager


def test_adapter_only_checkpoints_resume_exactly(tmp_path, base_dir):
    cfg = lora_cfg(tmp_path / "whole", base_dir)
    state, manager = start(cfg)
    whole = train(state, manager, 6, cfg)
    manager.close()

    cfg = lora_cfg(tmp_path / "cut", base_dir)
    state, manager = start(cfg)
    first = train(state, manager, 4, cfg)
    manager.close()
    step4 = tmp_path / "cut" / "checkpoint" / "step-4"
    stored = dcp_io.read_tensor_shapes(step4)
    weights = [key for key in stored if key.startswith("model.")]
    assert weights and all(is_lora(key) for key in weights)  # no frozen base weight
    assert any(key.startswith("optimizer.state.") and ".lora_b." in key for key in stored)
    base = read_record(step4).lora["base"]
    assert base["path"] == str(base_dir.resolve()) and base["in_hf"]

    state, manager = start(cfg)
    assert state.step == 4
    rest = train(state, manager, 6, cfg)
    manager.close()
    assert first + rest == whole


def test_a_base_gone_or_changed_is_refused(tmp_path, base_dir):
    base = tmp_path / "base"
    shutil.copytree(base_dir, base)
    cfg = lora_cfg(tmp_path / "run", base)
    state, manager = start(cfg)
    train(state, manager, 2, cfg)
    manager.close()
    from safetensors.torch import load_file, save_file

    weights = load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] += 1  # another model of the same shapes: only its values differ
    save_file(weights, str(base / "model.safetensors"), metadata=export_mark("hf"))
    with pytest.raises(DtrainError, match=r"holds LoRA adapters only; their frozen base weights were read from .*base, "
                                          r"which differs now \(the contents of its files changed\)"):
        start(cfg)
    shutil.rmtree(base)
    with pytest.raises(DtrainError, match=r"which no longer exists: put that base model back at .*base to load it"):
        start(cfg)


def test_a_resume_with_other_lora_settings_is_refused(tmp_path, base_dir):
    cfg = lora_cfg(tmp_path / "run", base_dir)
    state, manager = start(cfg)
    train(state, manager, 2, cfg)
    manager.close()
    with pytest.raises(DtrainError, match=r"lora.alpha = 4.0 differs from checkpoint .*step-2's 16.0: set lora.alpha"):
        start(lora_cfg(tmp_path / "run", base_dir, alpha=4.0))


def test_a_run_starts_from_a_peft_adapter(tmp_path, base_dir):
    cfg = lora_cfg(tmp_path / "run", base_dir)
    source = lora_model("llama3", cfg.lora)
    save_peft_adapter(dcp_io.model_state_dict([source]), tmp_path / "adapter", build_adapter("llama3", TINY_ARGS),
                      cfg.lora, torch.float32, base_model_name_or_path=str(base_dir))
    cfg.lora.initial_adapter_path = str(tmp_path / "adapter")
    state, manager = start(cfg)
    ours = dcp_io.model_state_dict(state.model_parts)
    for fqn, value in dcp_io.model_state_dict([source]).items():
        if is_lora(fqn):
            assert torch.equal(ours[fqn], value), fqn
    train(state, manager, 2, cfg)
    manager.close()
    # The adapters are now the run's own: its checkpoints hold them, and refer to the base only.
    assert read_record(tmp_path / "run" / "checkpoint" / "step-2").lora["base"]["path"] == str(base_dir.resolve())
