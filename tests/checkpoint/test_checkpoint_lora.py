"""A LoRA run through today's checkpoint manager: DCP saves the frozen base and the adapters with the adapters'
optimizer state, and a resumed run continues bit-identically."""

from __future__ import annotations

import torch
from checkpoint_helpers import make_cfg, manager_for, tiny_model, tiny_state, train

from dtrain.precision.lora import LoRATraining
from dtrain.step.rng import seed_everything


def test_lora_run_resumes_bit_identically(run_dir):
    cfg = make_cfg(run_dir)
    cfg.lora.enable = True
    cfg.lora.target_modules = ["all-linear"]
    lora = LoRATraining(cfg.lora)

    def lora_state():
        seed_everything(cfg.debug.seed, "init")
        model = tiny_model()
        lora.convert(model)
        lora.init(model, cfg.debug.seed)
        return tiny_state(cfg, model)

    state = lora_state()
    manager = manager_for(cfg, state)
    train(state, manager, 4, cfg)  # saves step-2 and step-4
    manager.close()

    resumed = lora_state()
    # Fresh adapters before the restore (lora_b zeros, the trained one is not), the saved ones after it.
    def lora_b(s):
        return s.model_parts[0].layers["0"].attention.wq.lora_b.weight

    assert not torch.equal(lora_b(resumed), lora_b(state))
    assert manager_for(cfg, resumed).restore_at_startup().step == 4
    saved, loaded = state.model_parts[0].state_dict(), resumed.model_parts[0].state_dict()
    assert all(torch.equal(saved[name], loaded[name]) for name in saved)
    assert len(resumed.optimizer.state) == len(state.optimizer.state) > 0
    assert train(resumed, None, 6, cfg) == train(state, None, 6, cfg)
