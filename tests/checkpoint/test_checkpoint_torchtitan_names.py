"""Initial loads of DCP checkpoints from elsewhere (no dtrain commit record): named as torchtitan >= 0.3 names them
(attention.qkv_linear.*, lm_head) or as torchtitan v0.2 does (our names), Qwen3's in HF's RoPE order. The weights
load exactly and train as the same weights under our names do; where the names cannot tell the layout (torchtitan
v0.2 Qwen3), checkpoint.initial_load_writer decides, and without it the load is refused in one line."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from checkpoint_helpers import FAMILY_ARGS, make_cfg, manager_for, tiny_model, tiny_state, train
from dist_harness import run_world
from torchtitan_checkpoints import save_torchtitan_checkpoint, torchtitan_name

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.config_checks import check_checkpoint_config
from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.folders import COMMIT_FILE, CommitRecord, commit
from dtrain.checkpoint.spellings import whole_tensor_batches
from dtrain.errors import ConfigError, DtrainError


def saved_weights(family: str, tmp_path, version: str = "0.3") -> dict[str, torch.Tensor]:
    """Weights unlike a fresh model's, saved as <tmp_path>/torchtitan (torchtitan `version`'s names and layout)
    and <tmp_path>/ours (our names and layout, no commit record)."""
    torch.manual_seed(7)
    weights = {k: v.detach().clone() for k, v in model_state_dict([tiny_model(family)]).items()}
    save_torchtitan_checkpoint(weights, family, FAMILY_ARGS[family], tmp_path / "torchtitan", version)
    dcp.save(weights, checkpoint_id=str(tmp_path / "ours"), no_dist=True)
    return weights


def start_from(source, family: str, run_dir, writer: str = "auto"):
    cfg = make_cfg(run_dir, family=family, initial_load_path=str(source), initial_load_writer=writer)
    state = tiny_state(cfg)
    startup = manager_for(cfg, state).restore_at_startup()
    return cfg, state, startup


@pytest.mark.parametrize(
    "family, version, writer, logged",
    [
        ("llama3", "0.3", "auto", "torchtitan >= 0.3"),  # untied
        ("qwen3", "0.3", "auto", "torchtitan >= 0.3"),  # tied, with QK-norm, HF's RoPE order
        ("qwen3", "0.3", "torchtitan", "torchtitan >= 0.3"),
        ("llama3", "0.2", "auto", None),  # our names and layout: nothing to tell apart
        ("llama3", "0.2", "torchtitan", "torchtitan v0.2"),
        ("qwen3", "0.2", "torchtitan", "torchtitan v0.2"),  # our names, HF's RoPE order
    ],
)
def test_torchtitan_checkpoints_load_the_saved_weights_and_train_as_ours_do(
    family, version, writer, logged, tmp_path, caplog
):
    weights = saved_weights(family, tmp_path, version)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        cfg, state, startup = start_from(tmp_path / "torchtitan", family, tmp_path / "run", writer)
    assert (startup.rule, startup.model_only) == ("initial_load", True)
    spelled = [r.message for r in caplog.records if "names the weights as" in r.message]
    assert spelled == ([] if logged is None else [spelled[0]]) and (logged is None or logged in spelled[0])
    foreign = [r for r in caplog.records if r.name == "dtrain" and COMMIT_FILE in r.message]
    assert [r.levelname for r in foreign] == ["WARNING"] and "read without checksums" in foreign[0].message
    loaded = model_state_dict(state.model_parts)
    assert loaded.keys() == weights.keys()
    assert [k for k in weights if not torch.equal(loaded[k], weights[k])] == []
    ours_cfg, ours_state, _ = start_from(tmp_path / "ours", family, tmp_path / "run_ours", "dtrain")
    assert train(state, None, 2, cfg) == train(ours_state, None, 2, ours_cfg)


def test_a_qwen3_checkpoint_under_our_names_is_refused_until_its_writer_is_named(tmp_path):
    weights = saved_weights("qwen3", tmp_path, "0.2")
    with pytest.raises(DtrainError) as err:
        start_from(tmp_path / "torchtitan", "qwen3", tmp_path / "run")
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'torchtitan'} has no {COMMIT_FILE}, and its names fit both dtrain's layout and "
        "torchtitan v0.2 (our names, HF's RoPE order in wq, wk and the QK-norms): set checkpoint.initial_load_writer "
        "to dtrain or torchtitan, whichever wrote it"
    )
    # Named as dtrain's, the same files load as they are: the q/k rows stay in torchtitan's order.
    _, state, _ = start_from(tmp_path / "torchtitan", "qwen3", tmp_path / "run_dtrain", "dtrain")
    loaded = model_state_dict(state.model_parts)
    assert not torch.equal(loaded["layers.0.attention.wq.weight"], weights["layers.0.attention.wq.weight"])
    assert torch.equal(loaded["layers.0.attention.wv.weight"], weights["layers.0.attention.wv.weight"])


def start_on_uneven_stages(rank: int, world_size: int, root: str) -> dict[str, tuple[list[str | None], bool]]:
    """Pipeline-like stages, rank 0 the whole Qwen3 model and rank 1 its embedding alone (named and laid out alike
    in every spelling), start from <root>/<version>/torchtitan: per version, each rank's refusal under auto (None
    where it loaded), and whether the weights then loaded exactly everywhere (after a refusal, under
    initial_load_writer = torchtitan)."""
    reports = {}
    for version in ("0.2", "0.3"):
        model = tiny_model("qwen3")
        if rank > 0:
            for index in list(model.layers):
                del model.layers[index]
            model.norm = model.output = None
        refusals: list[str | None] = [None] * world_size
        for writer in ("auto", "torchtitan"):
            cfg = make_cfg(Path(root) / version / writer, family="qwen3", initial_load_writer=writer,
                           initial_load_path=f"{root}/{version}/torchtitan")
            state = tiny_state(cfg, model=model)
            try:
                manager_for(cfg, state, rank, world_size).restore_at_startup()
                break
            except DtrainError as err:
                dist.all_gather_object(refusals, str(err))
        expected = torch.load(Path(root) / version / "weights.pt")
        loaded = model_state_dict(state.model_parts)
        exact = torch.tensor([all(torch.equal(v, expected[k]) for k, v in loaded.items())])
        dist.all_reduce(exact, op=dist.ReduceOp.MIN)
        reports[version] = (refusals, bool(exact))
    return reports


@pytest.mark.multiprocess
def test_pipeline_stages_agree_on_the_layout(tmp_path):
    """Every rank decides from the whole model's names: a stage whose own weights fit every spelling neither loads
    otherwise than the rest nor refuses alone (which would leave the others waiting in DCP's collective load)."""
    for version in ("0.2", "0.3"):
        torch.save(saved_weights("qwen3", tmp_path / version, version), tmp_path / version / "weights.pt")
    reports = run_world(2, start_on_uneven_stages, str(tmp_path), timeout_s=120)
    refusals, exact = reports["0.2"]
    assert len(set(refusals)) == 1 and "set checkpoint.initial_load_writer to dtrain or torchtitan" in refusals[0]
    assert exact
    assert reports["0.3"] == ([None, None], True)


def test_a_dtrain_checkpoint_is_ours_whatever_its_family(tmp_path, caplog):
    """A commit record makes a checkpoint dtrain's: Qwen3 under our names loads as it is, without a warning; naming
    torchtitan as its writer is refused."""
    torch.manual_seed(7)
    weights = {k: v.detach().clone() for k, v in model_state_dict([tiny_model("qwen3")]).items()}
    partial = tmp_path / "step-0.partial"
    dcp_io.save(weights, partial)
    record = CommitRecord(step=0, kind="model_only", dtype="float32", torch_version=torch.__version__,
                          saved_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          tie_word_embeddings=True)
    commit(partial, tmp_path / "step-0", record)
    with caplog.at_level(logging.WARNING, logger="dtrain"):
        _, state, _ = start_from(tmp_path / "step-0", "qwen3", tmp_path / "run")
    assert [r.message for r in caplog.records if r.name == "dtrain" and r.levelno >= logging.WARNING] == []
    loaded = model_state_dict(state.model_parts)
    assert [k for k in weights if not torch.equal(loaded[k], weights[k])] == []
    with pytest.raises(DtrainError) as err:
        start_from(tmp_path / "step-0", "qwen3", tmp_path / "run_tt", "torchtitan")
    assert str(err.value) == (
        f"checkpoint.initial_load_path {tmp_path / 'step-0'} has dtrain's {COMMIT_FILE}, so torchtitan did not "
        "write it; set checkpoint.initial_load_writer to auto or dtrain"
    )


def test_the_writer_of_a_hugging_face_start_must_stay_auto(tmp_path):
    cfg = make_cfg(tmp_path / "run", initial_load_path=str(tmp_path), initial_load_in_hf=True,
                   initial_load_writer="torchtitan")
    with pytest.raises(ConfigError, match=r"^checkpoint\.initial_load_writer = torchtitan is for DCP checkpoints; "
                                          r"with checkpoint\.initial_load_in_hf set it to auto$"):
        check_checkpoint_config(cfg.checkpoint, cfg.optimizer.name, world_size=1)
    cfg.checkpoint.initial_load_writer = "auto"
    check_checkpoint_config(cfg.checkpoint, cfg.optimizer.name, world_size=1)


def test_a_checkpoint_in_neither_spelling_names_the_missing_weight(tmp_path):
    torch.manual_seed(7)
    weights = model_state_dict([tiny_model()])
    stored = {torchtitan_name(k): v for k, v in weights.items() if k != "layers.1.feed_forward.w2.weight"}
    dcp.save(stored, checkpoint_id=str(tmp_path / "partial"), no_dist=True)
    with pytest.raises(DtrainError) as err:
        start_from(tmp_path / "partial", "llama3", tmp_path / "run")
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'partial'} does not hold weight layers.0.attention.wk.weight, "
        "layers.0.attention.wq.weight, layers.0.attention.wv.weight (and 5 more) of this model (a different "
        "model.name/flavor/args, or not a model checkpoint); set checkpoint.initial_load_partial = true to load only "
        "the weights both have"
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
