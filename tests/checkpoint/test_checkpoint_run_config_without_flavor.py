"""The tools that read a run's config.toml rebuild the model of a run started from a Hugging Face folder, whose
record names no flavor (its [model.args] gives every field): to-hf writes the weights back bit for bit and
run_generate generates what the Hugging Face folder itself generates, with that folder still there or gone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_checkpoint_convert import load_script
from test_checkpoint_hf_start import write_hf

from dtrain.checkpoint.hf_io import iter_hf_weights
from dtrain.config import load_config, to_toml
from dtrain.generate import main as generate_main
from dtrain.parallelize import get_family
from dtrain.run.prepare import prepare

PROMPT = ["--prompt_ids", "5,17,33,9", "--max_new_tokens", "8", "--device", "cpu", "--ignore_eos"]


def hf_weights(folder: Path, args) -> dict[str, torch.Tensor]:
    adapter = get_family("llama3").model.hf_adapter(args)
    with torch.device("meta"):
        names = list(get_family("llama3").model.model_cls(args).state_dict())
    return dict(iter_hf_weights(folder, adapter, names))


def generated(capsys, *argv: str) -> list[int]:
    assert generate_main([*argv, *PROMPT]) == 0, capsys.readouterr().err
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ids: "))
    return [int(i) for i in line.removeprefix("ids: ").split(",")]


@pytest.mark.parametrize("folder", ["kept", "gone"])
def test_to_hf_and_generate_rebuild_a_hf_started_run_from_its_config_toml(tmp_path, capsys, folder):
    hf, run = write_hf(tmp_path / "hf", "llama3"), tmp_path / "run"
    cfg = load_config(["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf",
                       "--checkpoint.initial_load_model_only", "--job.dump_folder", str(run)])
    args = prepare(cfg).model_args
    run.mkdir()
    (run / "config.toml").write_text(to_toml(cfg))
    assert cfg.model.flavor == "" and args.vocab_size == 320  # no flavor's shape
    convert, checkpoint = load_script(), run / "checkpoint" / "step-0"
    assert convert.main(["from-hf", str(hf), str(checkpoint)]) == 0  # the weights a run of it would save
    # The run decodes with the byte tokenizer, so its generation never picks the padding rows past its 258 ids;
    # the Hugging Face folder holds no tokenizer: it is given the same one.
    (tmp_path / "assets").mkdir()
    expected = generated(capsys, "--checkpoint", str(hf), "--hf", "--model.hf_assets_path", str(tmp_path / "assets"),
                         "--model.tokenizer", "byte")
    original = hf_weights(hf, args)
    if folder == "gone":
        for file in hf.iterdir():
            file.unlink()

    assert generated(capsys, "--checkpoint", str(checkpoint)) == expected
    assert convert.main(["to-hf", str(checkpoint), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    exported = hf_weights(tmp_path / "out", args)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)
