"""torchao's low-bit optimizer states through the trainer's checkpoint path (DCP with checksummed writes and verified
reads), in one process and under FSDP2 (DTensors of quantized tensors): the quantized moments come back
bit-identical and training continues bit-identically; a conversion reads them as plain dequantized tensors.
Through ./run_train.sh with a worker killed by SIGKILL: tests/e2e/test_run_train_elastic.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_helpers import REPO_ROOT, make_cfg, manager_for, tiny_state, train
from dist_harness import run_world
from reshard_worlds import layout_state
from torch.distributed.tensor import DTensor

from dtrain.checkpoint import check_checkpoint_config
from dtrain.checkpoint.optimizer_checks import check_optimizer
from dtrain.errors import ConfigError, DtrainError
from dtrain.step.train_step import train_step

STATE_CLASSES = {"AdamW8bit": "OptimState8bit", "AdamW4bit": "OptimState4bit", "AdamWFp8": "OptimStateFp8"}


def stored_tensors(value: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `value`: a quantized state's codes, scales (and table), else itself."""
    if hasattr(value, "__tensor_flatten__"):
        return [t for name in value.__tensor_flatten__()[0] for t in stored_tensors(getattr(value, name))]
    return [value]


def losses_and_rates(state, until: int) -> list[tuple[float, float]]:
    """(loss, learning rate) of each step up to `until`, as the trainer logs them (torchao holds the rate as a
    tensor that the schedule updates in place)."""
    logged = []
    while state.step < until:
        metrics = train_step(state, [next(state.dataloader)])
        logged.append((metrics["loss"].item(), float(metrics["lr"])))
    return logged


def identical_states(saved, resumed) -> bool:
    """Whether every optimizer state tensor of `resumed` holds the same bits as `saved`'s (this rank's shards)."""
    for before, after in zip(saved.parameters, resumed.parameters):
        for key, value in saved.optimizer.state[before].items():
            loaded = resumed.optimizer.state[after][key]
            if isinstance(value, DTensor):
                value, loaded = value.to_local(), loaded.to_local()
            if type(loaded) is not type(value) or not all(
                torch.equal(a, b) for a, b in zip(stored_tensors(value), stored_tensors(loaded), strict=True)
            ):
                return False
    return True


@pytest.mark.slow  # torchao compiles its step (see tests/step/test_optim.py)
@pytest.mark.parametrize("name", list(STATE_CLASSES))
def test_quantized_moments_resume_bit_identically(run_dir, name):
    cfg = make_cfg(run_dir)
    cfg.optimizer.name = name
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 4, cfg)  # saves step-2 and step-4
    manager.close()
    embedding = state.model_parts[0].tok_embeddings.weight  # 20480 elements: quantized in every format
    assert type(state.optimizer.state[embedding]["exp_avg"]).__name__ == STATE_CLASSES[name]

    resumed = tiny_state(cfg)
    assert manager_for(cfg, resumed).restore_at_startup().step == 4
    assert identical_states(state, resumed)
    assert losses_and_rates(resumed, 6) == losses_and_rates(state, 6)


@pytest.mark.slow
def test_a_conversion_reads_the_quantized_moments_as_plain_floats(run_dir, tmp_path):
    """In a fresh process, which has not imported torchao (whose classes the safe unpickler must admit)."""
    cfg = make_cfg(run_dir)
    cfg.optimizer.name = "AdamW8bit"
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 2, cfg)
    manager.close()
    out = tmp_path / "whole.pt"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "convert_checkpoint.py"), "to-torch",
         str(run_dir / "checkpoint" / "step-2"), str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    stored = torch.load(out, weights_only=True)["optimizer"]["state.tok_embeddings.weight.exp_avg"]
    moment = state.optimizer.state[state.model_parts[0].tok_embeddings.weight]["exp_avg"]
    assert type(stored) is torch.Tensor and torch.equal(stored, moment.dequantize())


def save_and_resume_each_format_under_fsdp2(rank: int, world_size: int, root: str) -> dict:
    """FSDP2 over the world, each format in turn (one compile cache for all): train 4 steps saving every 2, resume a
    fresh state from step-4, and report by format the embedding moment's local class, whether every rank's state
    came back bit-identical, and the next two losses of both runs."""
    reports = {}
    for name in STATE_CLASSES:
        cfg = make_cfg(Path(root) / name)
        cfg.optimizer.name = name
        state = layout_state(cfg, {"dp_shard": 2}, world_size, 4)
        manager = manager_for(cfg, state, rank, world_size)
        train(state, manager, 4, cfg)
        manager.close()
        resumed = layout_state(cfg, {"dp_shard": 2}, world_size, 4)
        manager_for(cfg, resumed, rank, world_size).restore_at_startup()
        identical = torch.tensor(int(identical_states(state, resumed)))
        dist.all_reduce(identical, op=dist.ReduceOp.MIN)
        moment = state.optimizer.state[state.model_parts[0].tok_embeddings.weight]["exp_avg"]
        reports[name] = {
            "class": type(moment.to_local()).__name__,
            "identical": bool(identical),
            "losses": (train(state, None, 6, cfg), train(resumed, None, 6, cfg)),
        }
    return reports


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quantized_dtensor_moments_resume_bit_identically_under_fsdp2(tmp_path):
    # The formats run one after another on the same parameters: without dtrain.step.optimizer's own compile cache key per
    # format, torch 2.13 hands the second one the first one's compiled step.
    reports = run_world(2, save_and_resume_each_format_under_fsdp2, str(tmp_path))
    for name, report in reports.items():
        assert report["class"] == STATE_CLASSES[name] and report["identical"], name
        uninterrupted, resumed = report["losses"]
        assert resumed == uninterrupted, name


def test_async_saves_are_refused_for_quantized_states(run_dir):
    cfg = make_cfg(run_dir, async_mode="async")
    cfg.optimizer.name = "AdamW4bit"
    with pytest.raises(ConfigError, match="async_mode = async cannot stage .* optimizer.name = AdamW4bit"):
        check_checkpoint_config(cfg.checkpoint, cfg.optimizer.name, 1)


def test_state_of_another_moment_format_is_refused_in_one_line_and_can_be_left_behind(run_dir, caplog):
    """AdamW's float moments would load whole into AdamW8bit (silently undoing its saving); the reverse fails in
    DCP's metadata. The record names the optimizer, so the resume refuses first and says what to do."""
    cfg = make_cfg(run_dir)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 2, cfg)
    manager.close()
    cfg.optimizer.name = "AdamW8bit"
    with pytest.raises(DtrainError) as refused:
        manager_for(cfg, tiny_state(cfg)).restore_at_startup()
    assert str(refused.value) == (
        f"checkpoint {run_dir / 'checkpoint' / 'step-2'} holds the optimizer state of optimizer.name = AdamW (float "
        "moments), which AdamW8bit (8bit moments) cannot continue: set optimizer.name = AdamW, or "
        'checkpoint.exclude_from_loading = ["optimizer"] to start the optimizer afresh'
    )
    cfg.checkpoint.exclude_from_loading = ["optimizer"]
    fresh = tiny_state(cfg)
    assert manager_for(cfg, fresh).restore_at_startup().step == 2 and not fresh.optimizer.state

    cfg.optimizer.name, cfg.checkpoint.exclude_from_loading = "Adam", []  # float moments too: continued
    with caplog.at_level("INFO", logger="dtrain"):
        assert manager_for(cfg, tiny_state(cfg)).restore_at_startup().step == 2
    assert "optimizer state saved by AdamW continues in Adam (the same moment format)" in caplog.text


@pytest.mark.parametrize(
    "saved, ours, refused",
    [("AdamW8bit", "AdamW", True), ("AdamW8bit", "AdamW4bit", True), ("AdamWFp8", "Adam8bit", True),
     ("AdamW8bit", "Adam8bit", False), ("", "AdamW4bit", False)],
)
def test_only_the_moment_format_decides(saved, ours, refused, tmp_path):
    if refused:
        with pytest.raises(DtrainError, match=f"optimizer.name = {saved} .* which {ours} "):
            check_optimizer(tmp_path, saved, ours)
    else:
        check_optimizer(tmp_path, saved, ours)
