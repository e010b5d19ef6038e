"""The last save holds only the weights, in export_dtype, readable without dtrain; config checks of [checkpoint]."""

from __future__ import annotations

import pytest
import torch
from checkpoint_helpers import make_cfg, manager_for, tiny_state, train
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dtrain.checkpoint import check_checkpoint_config
from dtrain.checkpoint.folders import read_record
from dtrain.errors import ConfigError


def test_last_save_is_model_only_in_export_dtype_and_loads_with_plain_torch(run_dir, tmp_path):
    cfg = make_cfg(run_dir, steps=2, interval=10, export_dtype="bfloat16")
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 2, cfg)
    manager.close()
    final = run_dir / "checkpoint" / "step-2"
    record = read_record(final)
    assert (record.kind, record.dtype, record.step) == ("model_only", "bfloat16", 2)

    dcp_to_torch_save(final, tmp_path / "model.pt")
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    expected = state.model_parts[0].state_dict()
    assert set(weights) == set(expected)  # torchtitan's flat FQNs, no "model." prefix
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name

    # The same weights start a new run (initial_load_path), upcast into the float32 model.
    new = make_cfg(tmp_path / "new", initial_load_path=str(final))
    fresh = tiny_state(new)
    assert manager_for(new, fresh).restore_at_startup().model_only
    assert torch.equal(fresh.model_parts[0].output.weight, weights["output.weight"].float())


def test_full_last_save_when_asked(run_dir):
    cfg = make_cfg(run_dir, steps=1, interval=10, last_save_model_only=False)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 1, cfg)
    manager.close()
    assert read_record(run_dir / "checkpoint" / "step-1").kind == "full"


def test_disabled_checkpointing_saves_nothing(run_dir):
    cfg = make_cfg(run_dir, steps=2, enable=False)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 2, cfg)
    assert not manager.maybe_save(2, preempted=True)
    manager.close()
    assert not (run_dir / "checkpoint").exists()


@pytest.mark.parametrize(
    "settings, world_size, message",
    [
        ({"exclude_from_loading": ["model"]}, 1, "may list optimizer, lr_scheduler, dataloader; got 'model'"),
        ({"initial_load_in_hf": True, "initial_load_model_only": False}, 1, "initial_load_model_only = true"),
        ({"create_seed_checkpoint": True}, 2, "runs in one process (got 2)"),
        ({"initial_load_path": "/no/such/checkpoint"}, 1, "/no/such/checkpoint does not exist"),
        ({"folder": "/abs"}, 1, "must be a relative folder"),
        ({"initial_load_partial": True, "initial_load_model_only": False}, 1,
         "initial_load_partial loads the weights of a DCP checkpoint only; set checkpoint.initial_load_model_only"),
    ],
)
def test_config_checks_name_the_key(tmp_path, settings, world_size, message):
    cfg = make_cfg(tmp_path, **settings)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_checkpoint_config(cfg.checkpoint, cfg.optimizer.name, world_size)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned staging is allowed where CUDA exists")
def test_pinned_memory_async_needs_cuda(tmp_path):
    with pytest.raises(ConfigError, match="async_with_pinned_mem needs CUDA.*use async_mode = async"):
        cfg = make_cfg(tmp_path, async_mode="async_with_pinned_mem")
        check_checkpoint_config(cfg.checkpoint, cfg.optimizer.name, 1)
