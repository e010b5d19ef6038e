"""torchtitan 0.2.2's optimizer, LR schedule, clipping and loss on given inputs, in a process of its own.

    python torchtitan_optim_reference.py REQUEST.pt ANSWER.pt

torchtitan's package imports its MoE kernels, which need triton, so it runs here behind the stand-in of
triton_stub.py and never in the pytest process. REQUEST.pt (torch.save of plain data) holds the cases that
test_torchtitan_optim_schedule.py builds; ANSWER.pt holds what torchtitan's own components make of them:

- `schedules`: the lr of every step of `build_lr_schedulers` over a run of `training_steps`;
- `updates`: `build_optimizers`' parameter groups, and the weights after `torchtitan.distributed.utils
  .clip_grad_norm_`, optimizer step and schedule step on the given gradients (its Trainer's order);
- `clips`: the norm and clipped gradients of `clip_grad_norm_` as its Trainer calls it (foreach, 2-norm);
- `losses`: `cross_entropy_loss` on the given logits and labels;
- `defaults`: its config defaults of these keys.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

from triton_stub import install_triton_stub


class TinyNet(nn.Module):
    """Matrices, an embedding, biases and norm weights: every kind of parameter weight decay can treat apart."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.rms = nn.RMSNorm(6)
        self.head = nn.Linear(6, 11, bias=False)


def run_schedule(case: dict) -> list[float]:
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config.job_config import LRScheduler, Optimizer
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers([nn.Linear(1, 1)], Optimizer(lr=case["lr"]), dims)
    schedulers = build_lr_schedulers(optimizers, LRScheduler(**case["lr_scheduler"]), case["training_steps"])
    lrs = []
    for _ in range(case["training_steps"] + 1):  # the rate after the last step too
        lrs.append(schedulers.schedulers[0].get_last_lr()[0])
        optimizers.step()
        try:
            schedulers.step()
        except AssertionError:  # past a schedule shorter than the run, without decay steps: torchtitan stops there
            break
    return lrs


def run_update(case: dict) -> dict:
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config.job_config import LRScheduler, Optimizer
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import clip_grad_norm_

    model = TinyNet()
    model.load_state_dict(case["weights"])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers([model], Optimizer(**case["optimizer"]), dims)
    schedulers = build_lr_schedulers(optimizers, LRScheduler(**case["lr_scheduler"]), len(case["grads"]))
    names = {param: name for name, param in model.named_parameters()}
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[p] for p in group["params"]]}
        for optimizer in optimizers.optimizers
        for group in optimizer.param_groups
    ]
    norms = []
    for grads in case["grads"]:  # Trainer.train_step after backward
        for name, param in model.named_parameters():
            param.grad = grads[name].clone()
        norms.append(clip_grad_norm_(list(model.parameters()), case["max_norm"], foreach=True).item())
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
    return {"groups": groups, "norms": norms, "weights": {k: v.detach() for k, v in model.state_dict().items()}}


def run_clip(case: dict) -> dict:
    from torchtitan.distributed.utils import clip_grad_norm_

    params = [nn.Parameter(torch.zeros_like(grad)) for grad in case["grads"]]
    for param, grad in zip(params, case["grads"]):
        param.grad = grad.clone()
    norm = clip_grad_norm_(params, case["max_norm"], foreach=True, pp_mesh=None, ep_enabled=False)
    return {"norm": norm, "grads": [param.grad for param in params]}


def main(request_path: str, answer_path: str) -> None:
    install_triton_stub()
    from torchtitan.components.loss import cross_entropy_loss

    from torchtitan.config.job_config import LRScheduler, Optimizer, Training

    request = torch.load(request_path, weights_only=True)
    answer = {
        "defaults": {
            **{f"optimizer.{k}": v for k, v in dataclasses.asdict(Optimizer()).items()},
            **{f"lr_scheduler.{k}": v for k, v in dataclasses.asdict(LRScheduler()).items()},
            "training.max_norm": Training().max_norm,
        },
        "schedules": [run_schedule(case) for case in request["schedules"]],
        "updates": [run_update(case) for case in request["updates"]],
        "clips": [run_clip(case) for case in request["clips"]],
        "losses": [cross_entropy_loss(logits, labels) for logits, labels in request["losses"]],
    }
    torch.save(answer, answer_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
