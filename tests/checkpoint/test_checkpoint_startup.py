"""The start-up rule's other branches and every error it reports: one line, naming the path and the way out; an
initial load that does not fit the model, or holds a NaN, is refused unless a partial load is asked for."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from checkpoint_helpers import FAMILY_ARGS, make_cfg, manager_for, tiny_model, tiny_state, train
from peft_helpers import lora_settings
from torch.distributed.checkpoint import FileSystemWriter

from dtrain.checkpoint import CheckpointManager, dcp_io
from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import build_adapter, save_hf
from dtrain.errors import DtrainError
from dtrain.models.llama3 import Transformer
from dtrain.precision.lora import apply_lora


@pytest.fixture
def saved(tmp_path):
    """A run directory with full checkpoints at steps 2 and 4 (no final save), and its config."""
    cfg = make_cfg(tmp_path / "saved", steps=10)
    state = tiny_state(cfg)
    manager = manager_for(cfg, state)
    train(state, manager, 4, cfg)
    manager.close()
    return cfg, state


def restore(cfg):
    state = tiny_state(cfg)
    return manager_for(cfg, state).restore_at_startup(), state


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_damaged_newest_is_an_error_unless_falling_back(saved, caplog):
    cfg, _ = saved
    newest = cfg_folder(cfg) / "step-4"
    data = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert f"checkpoint {newest} is damaged" in one_line(err) and "fallback_to_previous = true" in one_line(err)
    cfg.checkpoint.fallback_to_previous = True
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        startup, _ = restore(cfg)
    assert startup.step == 2 and "step-4 is damaged" in caplog.text


def test_unreadable_data_of_the_right_size_fails_loading_and_can_fall_back(saved):
    cfg, _ = saved
    data = next(p for p in (cfg_folder(cfg) / "step-4").iterdir() if p.suffix == ".distcp")
    data.write_bytes(bytes(data.stat().st_size))
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert "cannot load checkpoint" in one_line(err) and "step-4" in one_line(err)
    cfg.checkpoint.fallback_to_previous = True
    startup, state = restore(cfg)
    assert startup.step == 2 and state.step == 2
    data = next(p for p in (cfg_folder(cfg) / "step-2").iterdir() if p.suffix == ".distcp")
    data.write_bytes(bytes(data.stat().st_size))
    with pytest.raises(DtrainError) as err:  # nothing intact left: an error, not a fresh start
        restore(cfg)
    assert "could be loaded (tried step-2, step-4)" in one_line(err)


def test_incomplete_folders_are_reported_and_never_resumed(saved, caplog):
    cfg, _ = saved
    (cfg_folder(cfg) / "step-6.partial").mkdir()
    (cfg_folder(cfg) / "step-8").mkdir()
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        startup, _ = restore(cfg)
    assert startup.step == 4
    assert "without a commit record" in caplog.text and "step-6.partial, step-8" in caplog.text
    # Once the run is accepted, the leftover of our own interrupted save goes; a folder we did not write stays.
    assert not (cfg_folder(cfg) / "step-6.partial").exists() and (cfg_folder(cfg) / "step-8").is_dir()
    assert f"removed {cfg_folder(cfg) / 'step-6.partial'}, left by a save that never completed" in caplog.text


def test_load_step_picks_a_step_and_names_the_available_ones(saved):
    cfg, _ = saved
    cfg.checkpoint.load_step = 2
    assert restore(cfg)[0].step == 2
    cfg.checkpoint.load_step = 3
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert "checkpoint.load_step = 3" in one_line(err) and "complete steps: 2, 4" in one_line(err)


def test_seed_must_match(saved):
    cfg, _ = saved
    cfg.debug.seed = 5
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert "debug.seed = 0, this run has debug.seed = 5; set --debug.seed 0" in one_line(err)


def test_data_position_refuses_a_new_global_batch_but_not_a_new_dp_size(saved, caplog):
    cfg, _ = saved
    cfg.training.local_batch_size = 4
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    line = one_line(err)
    assert "(training.local_batch_size 4 x 1 data-parallel rank(s)) of 4 sequences differs" in line and "'s 2: " in line
    assert 'exclude_from_loading = ["dataloader"]' in line
    cfg.training.local_batch_size = 1
    cfg.training.global_batch_size = 2  # same global batch over 2 dp ranks of 1 sequence each
    state = tiny_state(cfg, dp_rank=1, dp_size=2)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        manager_for(cfg, state).restore_at_startup()
    assert "carries over from 1 to 2 data-parallel" in caplog.text
    assert state.dataloader.sequences_consumed == 4 * 2


def test_excluded_parts_start_fresh(saved):
    cfg, trained = saved
    cfg.checkpoint.exclude_from_loading = ["optimizer", "dataloader"]
    startup, state = restore(cfg)
    assert startup.step == 4 and state.step == 4
    assert not state.optimizer.state and state.dataloader.sequences_consumed == 0
    assert state.optimizer.param_groups[0]["lr"] == state.lr_scheduler.get_last_lr()[0]
    assert state.lr_scheduler.last_epoch == 4
    assert torch.equal(state.model_parts[0].norm.weight, trained.model_parts[0].norm.weight)


def test_nothing_to_restore_starts_from_scratch_unless_a_checkpoint_is_required(tmp_path):
    cfg = make_cfg(tmp_path / "empty")
    assert restore(cfg)[0].rule == "scratch"
    cfg.checkpoint.require_checkpoint = True
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert "require_checkpoint is set" in one_line(err)


def test_disabled_checkpointing_does_not_resume_and_says_so(saved, caplog):
    cfg, _ = saved
    cfg.checkpoint.enable = False
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        assert restore(cfg)[0].rule == "scratch"
    assert "checkpoint.enable is false: not resuming" in caplog.text


def test_initial_load_takes_weights_by_default_and_the_full_state_on_request(saved, tmp_path):
    source_cfg, trained = saved
    cfg = make_cfg(tmp_path / "new", initial_load_path=str(cfg_folder(source_cfg)))  # a run's folder: its newest
    startup, state = restore(cfg)
    assert (startup.rule, startup.step, startup.model_only) == ("initial_load", 0, True)
    assert startup.path.name == "step-4" and not state.optimizer.state
    assert torch.equal(state.model_parts[0].output.weight, trained.model_parts[0].output.weight)
    cfg.checkpoint.initial_load_model_only = False
    startup, state = restore(cfg)
    assert (startup.rule, startup.step, state.dataloader.sequences_consumed) == ("initial_load", 4, 8)


def make_source(path, kind):
    """An unusable initial_load_path of the given kind."""
    if kind == "file":
        path.write_text("x")
    elif kind != "missing":
        path.mkdir()
    if kind == "other files":
        (path / "notes.txt").write_text("x")
    if kind == "torn metadata":
        (path / ".metadata").write_bytes(b"junk")
    return path


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing", "does not exist"),
        ("empty", "is an empty folder"),
        ("file", "is a file; expected a DCP checkpoint folder"),
        ("other files", "neither a DCP checkpoint"),
        ("torn metadata", "cannot be read"),
    ],
)
def test_unusable_initial_load_path_is_an_error(tmp_path, kind, message):
    path = make_source(tmp_path / "source", kind)
    cfg = make_cfg(tmp_path / "new", initial_load_path=str(path))
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert f"checkpoint.initial_load_path {path}" in one_line(err) and message in one_line(err)


def test_full_state_needs_a_dtrain_checkpoint(tmp_path):
    foreign = tmp_path / "foreign"
    dcp_io.save({"w": torch.zeros(3)}, foreign)
    cfg = make_cfg(tmp_path / "new", initial_load_path=str(foreign), initial_load_model_only=False)
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert "not a dtrain checkpoint" in one_line(err) and "initial_load_model_only = true" in one_line(err)
    cfg.checkpoint.initial_load_model_only = True
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert "does not hold weight" in one_line(err)


def cfg_folder(cfg):
    from pathlib import Path

    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


@pytest.mark.parametrize("code, hint", [
    (errno.ENOSPC, "the disk is full ({free} bytes free on its file system): free some, lower "
                   "checkpoint.keep_latest_k, or move job.dump_folder"),
    (errno.EROFS, "its file system is read-only: move job.dump_folder"),
])
def test_a_full_or_read_only_disk_is_one_line_naming_the_folder_and_the_leftover_goes(tmp_path, monkeypatch,
                                                                                      caplog, code, hint):
    cfg = make_cfg(tmp_path / "run", steps=10)
    manager = manager_for(cfg, tiny_state(cfg))
    writer = FileSystemWriter.write_data

    def failing_write(self, plan, planner):
        raise OSError(code, os.strerror(code), str(self.path))

    monkeypatch.setattr(FileSystemWriter, "write_data", failing_write)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=0, free=4096))
    with pytest.raises(DtrainError) as err:
        manager.save(2)
    assert one_line(err).replace("4096", "{free}", 1) == (
        f"checkpoint {cfg_folder(cfg) / 'step-2.partial'}: save failed, the checkpoint could not be written ({hint}); "
        "the folder is removed on the next start"
    )
    monkeypatch.setattr(FileSystemWriter, "write_data", writer)
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        startup, _ = restore(cfg)  # the rerun is not blocked by the leftover, and removes it
    assert startup.rule == "scratch" and not (cfg_folder(cfg) / "step-2.partial").exists()


@pytest.mark.parametrize("saved_tied", [False, True])
def test_tied_and_untied_checkpoints_do_not_load_into_each_other(tmp_path, saved_tied):
    source = make_cfg(tmp_path / "source", steps=4)
    args = replace(FAMILY_ARGS["llama3"], tie_word_embeddings=saved_tied)
    state = tiny_state(source, model=Transformer(args))
    manager = manager_for(source, state, model_args=args)
    train(state, manager, 2, source)
    manager.close()
    cfg = make_cfg(tmp_path / "run", steps=4, initial_load_path=str(cfg_folder(source) / "step-2"))
    other = replace(args, tie_word_embeddings=not saved_tied)
    loading = manager_for(cfg, tiny_state(cfg, model=Transformer(other)), model_args=other)
    with pytest.raises(DtrainError) as err:
        loading.restore_at_startup()
    assert one_line(err) == (
        f"checkpoint {cfg_folder(source) / 'step-2'} was saved with tie_word_embeddings {str(saved_tied).lower()}, "
        f"this model has {str(not saved_tied).lower()}: loading it would "
        + ("copy its one shared weight into two" if saved_tied else "keep only one of its two weights")
        + f"; set model.tie_word_embeddings = {str(saved_tied).lower()}"
    )


def restore_into(cfg, args, lora=None):
    """Restore `cfg` into a model of `args` (with the adapters of `lora`), as the trainer would."""
    model = Transformer(args)
    if lora is not None:
        apply_lora(model, lora)
        cfg.lora = lora
    state = tiny_state(cfg, model=model)
    return CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, 0, 1, state, training=cfg.training, parallelism=cfg.parallelism,
        model=cfg.model, optimizer=cfg.optimizer, model_args=args, lora=cfg.lora,
    ).restore_at_startup(), state


@pytest.mark.parametrize("lora", [None, lora_settings()])
def test_an_initial_load_that_does_not_fit_is_refused_unless_partial(saved, tmp_path, caplog, lora):
    source, trained = saved
    step = cfg_folder(source) / "step-4"
    cfg = make_cfg(tmp_path / "new", initial_load_path=str(step))
    one_layer = replace(FAMILY_ARGS["llama3"], n_layers=1)
    with pytest.raises(DtrainError) as err:
        restore_into(cfg, one_layer, lora)
    assert one_line(err) == (
        f"checkpoint {step} holds layers.1.attention.wk.weight, layers.1.attention.wo.weight, "
        "layers.1.attention.wq.weight (and 6 more), which this model does not take (another model.flavor or "
        "model.args); set checkpoint.initial_load_partial = true to load only the weights both have"
    )
    cfg.checkpoint.initial_load_partial = True
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        _, state = restore_into(cfg, one_layer, lora)
    assert f"not loaded from {step}, which this model does not take: layers.1.attention.wk.weight, " in caplog.text
    assert torch.equal(state.model_parts[0].layers["0"].attention.wq.weight,
                       trained.model_parts[0].layers["0"].attention.wq.weight)
    with caplog.at_level(logging.WARNING, logger="dtrain"):  # the reverse: what the checkpoint lacks keeps its init
        restore_into(cfg, replace(FAMILY_ARGS["llama3"], n_layers=3), lora)
    assert f"not in {step}, kept at their initialisation: layers.2.attention.wk.weight, " in caplog.text


@pytest.mark.parametrize("source", ["dcp", "hf"])
def test_a_non_finite_initial_load_is_refused_naming_file_and_tensor(tmp_path, source):
    weights = model_state_dict([tiny_model()])
    weights["layers.1.feed_forward.w2.weight"][0, 3] = float("nan")
    folder = tmp_path / "source"
    if source == "dcp":
        dcp_io.save(weights, folder)
        where = f"checkpoint {folder}: layers.1.feed_forward.w2.weight"
    else:
        save_hf(weights, folder, build_adapter("llama3", FAMILY_ARGS["llama3"]), torch.float32)
        where = f"Hugging Face checkpoint {folder / 'model.safetensors'}: model.layers.1.mlp.down_proj.weight"
    cfg = make_cfg(tmp_path / "new", initial_load_path=str(folder), initial_load_in_hf=source == "hf")
    with pytest.raises(DtrainError) as err:
        restore(cfg)
    assert one_line(err) == (f"{where} holds NaN or Inf values; a checkpoint to start from must be finite (was it "
                             "saved from a diverged run, or damaged?)")
