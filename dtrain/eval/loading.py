"""The backend over a saved model: a dtrain checkpoint rebuilt by its run's config, or a Hugging Face folder.

Loading is generate.py's (`load_model`): the same checkpoint resolution (a run folder stands for its newest committed
step), the same refusal of a config that disagrees with the checkpoint's record, LoRA adapters merged into their
base. Each process holds the whole model on its own device; several processes split the requests (share.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from lm_eval.api.registry import register_model

from dtrain.errors import ConfigError
from dtrain.eval.backend import DtrainLM


def device_for_rank() -> torch.device:
    """This process's GPU under torchrun (LOCAL_RANK), else the CPU."""
    import os

    if torch.cuda.is_available():  # GPU-only path: one GPU per local rank
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def load_for_eval(
    checkpoint: str, hf: bool, config_argv: list[str], batch_size: int, dtype: torch.dtype | None = None,
    max_gen_toks: int | None = None,
) -> DtrainLM:
    """The backend over `checkpoint` (with `hf`, a Hugging Face folder) on this process's device; `config_argv`
    are config flags (--config, --model.*) as run_generate.sh takes them. Weights and compute in `dtype`
    (default: bfloat16 on GPU, float32 on CPU)."""
    from dtrain.generate import load_model

    device = device_for_rank()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    opts = argparse.Namespace(checkpoint=Path(checkpoint), hf=hf, ignore_eos=False)
    loaded = load_model(opts, config_argv, device, dtype)
    if loaded.tokenizer is None:
        raise ConfigError(
            f"--checkpoint {checkpoint} has no tokenizer (tokenizer.json or tokenizer.model); pass "
            "--model.hf_assets_path with the model's tokenizer folder"
        )
    extra = {"max_gen_toks": max_gen_toks} if max_gen_toks else {}
    return DtrainLM(
        loaded.model, loaded.tokenizer, loaded.max_seq_len, device, eos_ids=loaded.eos_ids, batch_size=batch_size,
        **extra,
    )


@register_model("dtrain")
class SavedModelLM(DtrainLM):
    """The backend under its harness name, built from `--model_args checkpoint=PATH[,hf=true][,batch_size=N]`
    (with dtrain.eval.loading imported: `lm_eval.simple_evaluate(model="dtrain", model_args=...)`)."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DtrainLM:
        from lm_eval.utils import simple_parse_args_string

        args = {**simple_parse_args_string(arg_string), **(additional_config or {})}
        if "checkpoint" not in args:
            raise ConfigError("model_args: the dtrain model needs checkpoint=<run, step or Hugging Face folder>")
        return load_for_eval(str(args["checkpoint"]), bool(args.get("hf", False)), [], int(args.get("batch_size") or 1))
