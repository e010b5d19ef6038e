"""A LoRA run's exports: its last save with checkpoint.last_save_in_hf is the merged model, and
scripts/convert_checkpoint.py on its adapter-only checkpoint writes the adapter that PEFT loads onto the transformers
base (to-peft) and the merged model (to-hf), all with the run's logits (fp32, 1e-5); run_generate.sh reads that
checkpoint as the same model; a config that contradicts the checkpoint's record, an uncommitted checkpoint and an
output folder that holds another kind of export are refused in one line."""

from __future__ import annotations

import copy
import re
import shutil

import pytest
import torch
from test_checkpoint_convert import load_script
from test_peft_lora_checkpoints import base_dir, lora_cfg, start  # noqa: F401 (base_dir: a fixture)
from checkpoint_helpers import TINY_ARGS, train

from dtrain.config import to_toml
from dtrain.errors import DtrainError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def logits_of(model, folder=None, adapter=None) -> torch.Tensor:
    """Logits of dtrain's `model`, or of the transformers model in `folder` (with the PEFT `adapter` on it)."""
    tokens = torch.randint(0, TINY_ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if folder is None:
            return model.eval()(tokens)
        hf = transformers.LlamaForCausalLM.from_pretrained(str(folder), attn_implementation="eager")
        if adapter is not None:
            hf = peft.PeftModel.from_pretrained(hf, str(adapter))
        return hf.eval()(input_ids=tokens).logits


def test_a_lora_run_exports_to_peft_and_merged_hf(tmp_path, base_dir):  # noqa: F811
    cfg = lora_cfg(tmp_path / "run", base_dir)
    cfg.training.steps = 4
    cfg.checkpoint.last_save_in_hf = True  # the run's own last save: the merged model
    cfg.optimizer.lr = 0.05  # adapters far from their init (lora_b starts at zero)
    state, manager = start(cfg)
    train(state, manager, 2, cfg)
    at_step_2 = logits_of(state.model_parts[0])
    train(state, manager, 4, cfg)
    manager.close()
    last_save = tmp_path / "run" / "checkpoint" / "step-4"
    assert (logits_of(state.model_parts[0]) - logits_of(None, last_save)).abs().max() < 1e-5

    (tmp_path / "run" / "config.toml").write_text(to_toml(cfg))
    convert = load_script()
    checkpoint = tmp_path / "run" / "checkpoint" / "step-2"  # adapter-only DCP
    assert convert.main(["to-peft", str(checkpoint), str(tmp_path / "adapter")]) == 0
    assert convert.main(["to-hf", str(checkpoint), str(tmp_path / "merged"), "--dtype", "float32"]) == 0
    assert (at_step_2 - logits_of(None, base_dir)).abs().max() > 1e-3  # training moved the adapters
    assert (at_step_2 - logits_of(None, base_dir, tmp_path / "adapter")).abs().max() < 1e-5
    assert (at_step_2 - logits_of(None, tmp_path / "merged")).abs().max() < 1e-5

    from dtrain import generate

    opts, rest = generate.parse_args(["--checkpoint", str(checkpoint), "--prompt_ids", "1"])
    loaded = generate.load_model(opts, rest, torch.device("cpu"), torch.float32)
    assert (at_step_2 - logits_of(loaded.model)).abs().max() < 1e-5


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_dir):  # noqa: F811
    """A LoRA run (rank 8, alpha 16) of 2 steps from the base, with its config.toml: (its config, step-2)."""
    run = tmp_path_factory.mktemp("lora") / "run"
    cfg = lora_cfg(run, base_dir)
    cfg.training.steps = 2
    state, manager = start(cfg)
    train(state, manager, 2, cfg)
    manager.close()
    (run / "config.toml").write_text(to_toml(cfg))
    return cfg, run / "checkpoint" / "step-2"


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_exports_and_generation_refuse_lora_settings_the_record_contradicts(lora_run, tmp_path, capsys):
    cfg, checkpoint = lora_run
    other = copy.deepcopy(cfg)
    other.lora.alpha = 64.0
    (tmp_path / "alpha.toml").write_text(to_toml(other))
    said = (f"--config {tmp_path / 'alpha.toml'} has lora.alpha = 64.0, but checkpoint {checkpoint} records 16.0 "
            "(what it was trained with): set lora.alpha = 16.0 there")
    convert = load_script()
    for command in ("to-hf", "to-peft"):
        argv = [command, str(checkpoint), str(tmp_path / "out"), "--config", str(tmp_path / "alpha.toml")]
        assert convert.main(argv) == 1
        assert one_error(capsys) == f"error: {said}"
    assert not (tmp_path / "out").exists()
    from dtrain import generate

    opts, rest = generate.parse_args(["--checkpoint", str(checkpoint), "--prompt_ids", "1",
                                      "--config", str(tmp_path / "alpha.toml")])
    with pytest.raises(DtrainError, match=re.escape(said)):
        generate.load_model(opts, rest, torch.device("cpu"), torch.float32)
    # A copied checkpoint with a config of no LoRA: the record says what the checkpoint is.
    other.lora.enable = False
    (tmp_path / "plain.toml").write_text(to_toml(other))
    copied = shutil.copytree(checkpoint, tmp_path / "copied" / "step-2")
    assert convert.main(["to-peft", str(copied), str(tmp_path / "out"), "--config", str(tmp_path / "plain.toml")]) == 1
    assert one_error(capsys) == (
        f"error: --config {tmp_path / 'plain.toml'} has lora.enable = false, but checkpoint {copied} records true "
        "(what it was trained with): set lora.enable = true there"
    )


def test_a_lora_runs_uncommitted_checkpoint_is_one_line(lora_run, tmp_path, capsys):
    _, checkpoint = lora_run
    partial = shutil.copytree(checkpoint, checkpoint.with_name("step-4.partial"))
    try:
        assert load_script().main(["to-hf", str(partial), str(tmp_path / "out")]) == 2
    finally:
        shutil.rmtree(partial)
    assert one_error(capsys) == (f"error: checkpoint {partial} is uncommitted (a save that never finished) and is "
                                 f"never loaded; the latest committed one is {checkpoint}")


def test_an_adapter_export_never_mixes_with_a_model(lora_run, tmp_path, capsys):
    _, checkpoint = lora_run
    convert, merged, adapter = load_script(), tmp_path / "merged", tmp_path / "adapter"
    assert convert.main(["to-hf", str(checkpoint), str(merged)]) == 0
    assert convert.main(["to-peft", str(checkpoint), str(merged)]) == 2
    assert one_error(capsys) == (f"error: output {merged} is not empty and holds config.json, which to-peft does "
                                 "not write: name a new or empty folder (an earlier to-peft export there is replaced)")
    assert sorted(p.name for p in merged.iterdir()) == ["config.json", "model.safetensors"]
    for _ in range(2):  # the second replaces the first
        assert convert.main(["to-peft", str(checkpoint), str(adapter)]) == 0
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    (merged / "model.safetensors").rename(merged / "adapter_model.safetensors")  # a to-hf file under PEFT's name
    (merged / "config.json").unlink()
    assert convert.main(["to-peft", str(checkpoint), str(merged)]) == 2
    assert one_error(capsys) == (f"error: output {merged} holds adapter_model.safetensors, which is a to-hf export: "
                                 "name a new or empty folder (an earlier to-peft export there is replaced)")
