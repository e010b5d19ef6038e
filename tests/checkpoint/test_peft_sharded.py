"""A LoRA run's weights and checkpoints on sharded layouts, in one 2-rank gloo world: the Hugging Face base and a
PEFT adapter load into FSDP2's shards exactly, its adapter-only checkpoints resume under TP, and both layouts
reproduce the single-process run (fp32, 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_harness import run_world
from peft_helpers import lora_model
from peft_worlds import fsdp_then_tp
from test_peft_lora_checkpoints import base_dir, lora_cfg, start  # noqa: F401 (base_dir: a fixture)
from checkpoint_helpers import TINY_ARGS, train

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.hf_io import build_adapter, iter_hf_weights
from dtrain.checkpoint.peft_export import save_peft_adapter
from dtrain.checkpoint.peft_names import is_lora

pytestmark = pytest.mark.multiprocess


def test_fsdp2_starts_from_base_and_adapter_and_tp_resumes_its_checkpoint(tmp_path, base_dir):  # noqa: F811
    cfg = lora_cfg(tmp_path / "one_process", base_dir)
    source = dcp_io.model_state_dict([lora_model("llama3", cfg.lora)])
    hf_adapter = build_adapter("llama3", TINY_ARGS)
    save_peft_adapter(source, tmp_path / "adapter", hf_adapter, cfg.lora, torch.float32)
    cfg.lora.initial_adapter_path = str(tmp_path / "adapter")
    state, manager = start(cfg)
    expected = train(state, None, 4, cfg)
    manager.close()

    cfg.job.dump_folder = str(tmp_path / "sharded")
    torch.save(cfg, tmp_path / "cfg.pt")
    report = run_world(2, fsdp_then_tp, str(tmp_path / "cfg.pt"))

    started = report["started"]
    base = dict(iter_hf_weights(base_dir, hf_adapter, [fqn for fqn in started if not is_lora(fqn)]))
    for fqn, value in started.items():
        assert torch.equal(value, source[fqn] if is_lora(fqn) else base[fqn]), fqn
    assert all(is_lora(k) for k in dcp_io.read_tensor_shapes(Path(report["step2"])) if k.startswith("model."))
    assert report["resumed_at"] == 2
    torch.testing.assert_close(report["fsdp"], expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(report["tp"], expected[2:], rtol=1e-5, atol=0)
