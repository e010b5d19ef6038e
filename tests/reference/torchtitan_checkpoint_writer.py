"""A torchtitan 0.2.2 checkpoint, written by torchtitan's own model and checkpointer, with its logits.

    python torchtitan_checkpoint_writer.py OUT_DIR SPEC_JSON

SPEC_JSON is {"family": "llama3" | "qwen3", "args": {...}, "ids": [[...], ...]}: the model's args as torchtitan's
``TransformerModelArgs`` / ``Qwen3ModelArgs`` take them (``rope_scaling_args`` as a dict), and the token ids to run.
torchtitan's model is built on the meta device, materialised and initialised with its ``init_weights``, as its
Trainer does with ``checkpoint.create_seed_checkpoint``; torchtitan's ``CheckpointManager`` then saves it as the
seed checkpoint (``save(curr_step=0, last_step=True)``: model-only, weights at the top level) to
OUT_DIR/checkpoint/step-0. OUT_DIR/logits.pt holds the model's float32 logits of the ids.

A subprocess of the test: torchtitan's Qwen3 imports its MoE code, which imports triton (triton_stub.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from triton_stub import install_triton_stub


def build_model(family: str, args: dict) -> torch.nn.Module:
    if family == "llama3":
        from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer

        scaling = RoPEScalingArgs(**args.pop("rope_scaling_args"))
        return Transformer(TransformerModelArgs(**args, rope_scaling_args=scaling))
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    return Qwen3Model(Qwen3ModelArgs(**args))


def main(out: Path, spec: dict) -> None:
    install_triton_stub()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import Checkpoint

    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(spec["family"], dict(spec["args"]))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.eval()

    config = Checkpoint(enable=True, folder="checkpoint", keep_latest_k=0, last_save_model_only=True)
    checkpointer = CheckpointManager(
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
        checkpoint_config=config, sd_adapter=None, base_folder=str(out),
    )
    checkpointer.save(curr_step=0, last_step=True)
    checkpointer.close()

    with torch.no_grad():
        logits = model(torch.tensor(spec["ids"]))
    torch.save({"logits": logits.float()}, out / "logits.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
