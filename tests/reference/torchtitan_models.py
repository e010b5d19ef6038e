"""torchtitan 0.2.2's model flavors and initialisation, read from its own code (one process, CPU).

    python torchtitan_models.py FAMILY OUT.json [FLAVOR OVERRIDES_JSON [--forward]]

Writes OUT.json: ``{"flavors": {name: args}}``, every flavor of FAMILY's train spec as a dict of its args
(nested dataclasses as dicts), and, given FLAVOR, ``"init": {fqn: stats}``: ``param_stats`` of that flavor's model
(its args with OVERRIDES, dotted for nested fields, e.g. ``{"moe_args.num_experts": 8}``) built on the meta device,
materialised and initialised by its own ``init_weights`` after ``torch.manual_seed(0)``, as torchtitan's Trainer
does. The test process imports ``param_stats`` from here to describe dtrain's models the same way.

With ``--forward`` it also saves OUT.pt: ``{"state_dict": ..., "tokens": ..., "logits": ...}``, the model's
weights and its logits on seeded random tokens, with its MoE computed in float32 on the CPU (torchtitan_moe_cpu.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch import nn


# torch's trunc_normal_ draws uniform_ in [2 cdf(a) - 1, 2 cdf(b) - 1) and maps it through erfinv: with the default
# bounds +-2 at std 0.02, cdf(a) is 0, a draw of exactly -1 (one in 2**24) becomes -inf and is clamped to -2. Such a
# value is torch's, on both sides alike, and one of them moves a weight's std by a percent: it is counted apart.
CLAMPED = 2.0


def param_stats(model: nn.Module) -> dict[str, dict]:
    """Shape, mean, std, min, max of every parameter by name (a tied weight under each of its names), in float64,
    over the values other than exactly +-CLAMPED, which are counted as "clamped"."""
    stats = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        values = param.detach().double().flatten()
        clamped = values.abs() == CLAMPED
        values = values[~clamped]
        stats[name] = {
            "shape": list(param.shape),
            "mean": values.mean().item(),
            "std": values.std().item() if values.numel() > 1 else 0.0,
            "min": values.min().item(),
            "max": values.max().item(),
            "clamped": int(clamped.sum()),
        }
    return stats


def _with_overrides(args, overrides: dict):
    args = copy.deepcopy(args)
    for dotted, value in overrides.items():
        *path, field = dotted.split(".")
        owner = args
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, field, value)
    return args


FORWARD_TOKENS = (2, 32)


def main(family: str, out: Path, flavor: str | None, overrides: dict, forward: bool) -> None:
    from torchtitan_moe_cpu import run_moe_in_float32_on_cpu
    from triton_stub import install_triton_stub

    install_triton_stub()
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(family)
    result = {"flavors": {name: dataclasses.asdict(args) for name, args in spec.model_args.items()}}
    if flavor is not None:
        args = _with_overrides(spec.model_args[flavor], overrides)
        # update_from_config sets it from the run (DeepSeek-V3's MoE reads it at construction).
        args.moe_impl = "standard"
        run_moe_in_float32_on_cpu(args)
        with torch.device("meta"):
            model = spec.model_cls(args)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        result["init"] = param_stats(model)
        if forward:
            tokens = torch.randint(0, args.vocab_size, FORWARD_TOKENS, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                logits = model(tokens)
            torch.save({"state_dict": model.state_dict(), "tokens": tokens, "logits": logits}, out.with_suffix(".pt"))
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(argv[0], Path(argv[1]), argv[2] if len(argv) > 2 else None, json.loads(argv[3]) if len(argv) > 3 else {},
         "--forward" in argv[4:])
