"""Initial loads of DCP checkpoints named as torchtitan >= 0.3 names them (attention.qkv_linear.*, lm_head; Qwen3
in HF's RoPE order): the weights load exactly, and train as the same weights under our names do."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_helpers import FAMILY_ARGS, make_cfg, manager_for, tiny_model, tiny_state, train
from torchtitan_checkpoints import save_torchtitan_checkpoint, torchtitan_name

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.spellings import whole_tensor_batches
from dtrain.errors import DtrainError


def saved_weights(family: str, tmp_path) -> dict[str, torch.Tensor]:
    """Weights unlike a fresh model's, saved as <tmp_path>/torchtitan (its names) and <tmp_path>/ours."""
    torch.manual_seed(7)
    weights = {k: v.detach().clone() for k, v in model_state_dict([tiny_model(family)]).items()}
    save_torchtitan_checkpoint(weights, family, FAMILY_ARGS[family], tmp_path / "torchtitan")
    dcp.save(weights, checkpoint_id=str(tmp_path / "ours"), no_dist=True)
    return weights


def start_from(source, family: str, run_dir):
    cfg = make_cfg(run_dir, family=family, initial_load_path=str(source))
    state = tiny_state(cfg)
    startup = manager_for(cfg, state).restore_at_startup()
    return cfg, state, startup


@pytest.mark.parametrize("family", ["llama3", "qwen3"])  # untied, and tied with QK-norm
def test_torchtitan_names_load_the_saved_weights_and_train_as_ours_do(family, tmp_path, caplog):
    weights = saved_weights(family, tmp_path)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        cfg, state, startup = start_from(tmp_path / "torchtitan", family, tmp_path / "run")
    assert (startup.rule, startup.model_only) == ("initial_load", True)
    assert "names the weights as torchtitan >= 0.3" in caplog.text
    loaded = model_state_dict(state.model_parts)
    assert loaded.keys() == weights.keys()
    assert [k for k in weights if not torch.equal(loaded[k], weights[k])] == []
    ours_cfg, ours_state, _ = start_from(tmp_path / "ours", family, tmp_path / "run_ours")
    assert train(state, None, 2, cfg) == train(ours_state, None, 2, ours_cfg)


def test_a_checkpoint_in_neither_spelling_names_the_missing_weight(tmp_path):
    torch.manual_seed(7)
    weights = model_state_dict([tiny_model()])
    stored = {torchtitan_name(k): v for k, v in weights.items() if k != "layers.1.feed_forward.w2.weight"}
    dcp.save(stored, checkpoint_id=str(tmp_path / "partial"), no_dist=True)
    with pytest.raises(DtrainError) as err:
        start_from(tmp_path / "partial", "llama3", tmp_path / "run")
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'partial'} does not hold weight layers.0.attention.wq.weight and 7 more of this "
        "model (a different model.name/flavor, or not a model checkpoint)"
    )


def test_a_torchtitan_checkpoint_of_another_shape_names_its_tensor(tmp_path):
    torch.manual_seed(7)
    weights = model_state_dict([tiny_model()])
    weights["layers.0.attention.wq.weight"] = torch.zeros(32, 64)
    dcp.save({torchtitan_name(k): v for k, v in weights.items()}, checkpoint_id=str(tmp_path / "other"), no_dist=True)
    with pytest.raises(DtrainError, match=r"holds layers\.0\.attention\.qkv_linear\.wq\.weight with shape \[32, 64\], "
                                          r"this model's is \[64, 64\]"):
        start_from(tmp_path / "other", "llama3", tmp_path / "run")


def test_whole_tensors_are_read_in_batches_within_the_budget():
    weights = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(12), "d": torch.zeros(2)}  # 16, 16, 48, 8 B
    assert whole_tensor_batches(["a", "b", "c", "d"], weights, None, budget=32) == [["a", "b"], ["c"], ["d"]]
