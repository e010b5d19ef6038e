"""The step hooks of families with MoE layers (``FamilySpec.extra_loss``, ``extra_loss_terms``,
``after_optimizer_step``, ``step_metrics``) and the reduction that makes their statistics global.

- ``moe_aux_loss`` / ``moe_aux_loss_terms``: the sum of the layers' auxiliary losses of the last forward, and how
  many layers have one; the step adds their mean (Hugging Face's ``router_aux_loss_coef`` meaning), and under
  pipeline parallel each stage its own share (pipeline_extra_loss.py).
- ``after_moe_step``: sums every layer's token counts over ``dp_cp`` in one all-reduce after each optimizer step,
  giving each layer's load imbalance and moving the loss-free routing bias alike on every rank.
- ``moe_step_metrics``: that imbalance per layer and its maximum, for metrics.jsonl and TensorBoard.
- ``reduce_expert_loads_over``: sets each layer's ``reduce_expert_counts`` to a sum over ``dp_cp``, so the
  auxiliary loss sees the whole data-parallel microbatch (TP ranks route the same tokens and are not in it).

Why these groups and what is logged: docs/parallelism.md, "Expert parallel" ("Load balancing", "Metrics").
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrain.models.decoder import DecoderArgs
from dtrain.models.moe import MoE, update_expert_bias

LOAD_GROUP_ATTR = "_dtrain_load_reduce_group"
IMBALANCE_ATTR = "_dtrain_load_imbalance"


def moe_layers(model_parts: list[nn.Module]) -> list[MoE]:
    return [module for part in model_parts for module in part.modules() if isinstance(module, MoE)]


def reduce_expert_loads_over(model: nn.Module, mesh: DeviceMesh) -> None:
    """Have `model`'s MoE layers sum their token counts over `mesh` (its ranks see different tokens)."""
    if mesh.size() == 1:
        return
    for moe in moe_layers([model]):
        setattr(moe, LOAD_GROUP_ATTR, mesh.get_group())
        moe.reduce_expert_counts = functools.partial(sum_counts_over, group=mesh.get_group())


def sum_counts_over(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`counts` summed over `group`: a functional all-reduce, which ``torch.compile`` traces (no autograd: counts
    carry no gradient)."""
    return funcol.wait_tensor(funcol.all_reduce(counts, "sum", group))


def aux_loss_enabled(args: DecoderArgs) -> bool:
    """Whether a model of `args` has MoE layers with an auxiliary loss (``args.moe``, models/moe.py)."""
    moe = args.moe
    return moe is not None and moe.aux_loss_coeff > 0


def moe_aux_loss(model_parts: list[nn.Module]) -> torch.Tensor | None:
    losses = [moe.aux_loss for moe in moe_layers(model_parts) if moe.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def moe_aux_loss_terms(model_parts: list[nn.Module]) -> int:
    """How many layers of `model_parts` have an auxiliary loss (what ``moe_aux_loss`` sums in training)."""
    return sum(1 for moe in moe_layers(model_parts) if moe.aux_loss_coeff > 0)


def after_moe_step(model_parts: list[nn.Module]) -> None:
    layers = moe_layers(model_parts)
    if not layers:
        return
    loads = torch.stack([moe.tokens_per_expert for moe in layers])
    group = getattr(layers[0], LOAD_GROUP_ATTR, None)
    if group is not None:
        dist.all_reduce(loads, group=group)
    # A layer that saw no tokens (a step skipped before any forward) has mean 0: count its imbalance as 1.
    imbalance = loads.max(dim=1).values / loads.mean(dim=1).clamp(min=torch.finfo(loads.dtype).tiny)
    for moe, load, layer_imbalance in zip(layers, loads, imbalance):
        setattr(moe, IMBALANCE_ATTR, torch.where(load.sum() > 0, layer_imbalance, torch.ones_like(layer_imbalance)))
        if moe.expert_bias is not None:
            update_expert_bias(moe, load)
        else:
            moe.tokens_per_expert.zero_()


def moe_step_metrics(model_parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    named = [(name, module) for part in model_parts for name, module in part.named_modules() if isinstance(module, MoE)]
    metrics = {
        f"moe/{_layer_name(name)}/load_imbalance": getattr(moe, IMBALANCE_ATTR)
        for name, moe in named
        if hasattr(moe, IMBALANCE_ATTR)
    }
    if metrics:
        metrics["moe/load_imbalance_max"] = torch.stack(list(metrics.values())).max()
    return metrics


def _layer_name(module_name: str) -> str:
    """``layers.3.moe`` (also inside activation-checkpoint and compile wrappers) -> ``layers.3``."""
    parts = [p for p in module_name.split(".") if not p.startswith("_") and p != "moe"]
    return ".".join(parts)


# What a family with MoE layers passes to its FamilySpec (``FamilySpec(..., **MOE_STEP_HOOKS)``).
MOE_STEP_HOOKS = dict(
    extra_loss=moe_aux_loss,
    extra_loss_terms=moe_aux_loss_terms,
    extra_loss_enabled=aux_loss_enabled,
    after_optimizer_step=after_moe_step,
    step_metrics=moe_step_metrics,
)
