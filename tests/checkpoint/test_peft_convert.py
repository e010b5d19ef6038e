"""A LoRA run's exports: its last save with checkpoint.last_save_in_hf is the merged model, and
scripts/convert_checkpoint.py on its adapter-only checkpoint writes the adapter that PEFT loads onto the transformers
base (to-peft) and the merged model (to-hf), all with the run's logits (fp32, 1e-5); run_generate.sh reads that
checkpoint as the same model."""

from __future__ import annotations

import pytest
import torch
from test_checkpoint_convert import load_script
from test_peft_lora_checkpoints import base_dir, lora_cfg, start  # noqa: F401 (base_dir: a fixture)
from checkpoint_helpers import TINY_ARGS, train

from dtrain.config import to_toml

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
