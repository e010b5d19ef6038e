"""The reference model of DPO and IPO: the log-probabilities the policy's are compared with, never trained.

- `FrozenCopy`: a second model built like the policy (the same parallelize plan, so sharded like it), without
  gradients or optimizer state, holding the policy's weights as they are at the first step of the run (after the
  start-up load): the starting point DPO measures the policy's drift from.
- `AdaptersOff`: for a LoRA run, the policy itself with its adapters' contribution switched off (their scaling
  set to 0 for the forward), which is the frozen base: no second copy of the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from dtrain.precision.lora import LoRALinear
from dtrain.preference.loss import Microbatch, answer_logps


def _forward_logps(model: nn.Module, microbatch: Microbatch) -> torch.Tensor:
    with torch.no_grad():
        output = model(microbatch["input_ids"], document_ids=microbatch.get("document_ids"))
        return answer_logps(output, microbatch["labels"])[0]


class FrozenCopy:
    """A frozen copy of the policy's weights at its first use (`parts`: built like the policy's parts)."""

    def __init__(self, parts: list[nn.Module], policy: list[nn.Module]):
        # Its parameters keep requires_grad as built (DDP refuses a module with none to train): its forward runs
        # under no_grad, so it never has gradients, and no optimizer holds it.
        self.parts, self.policy, self._copied = parts, policy, False

    def _copy_policy(self) -> None:
        # Through the distributed state dicts: they see FSDP2's sharded parameters whatever state its hooks left
        # them in. By name: a LoRA policy's linears keep their weights under the plain model's names, and its
        # adapters are not the reference's (strict=False).
        weights = {key: value for part in self.policy for key, value in get_model_state_dict(part).items()}
        for part in self.parts:
            set_model_state_dict(part, weights, options=StateDictOptions(strict=False))
        self._copied = True

    def logps(self, microbatch: Microbatch) -> torch.Tensor:
        if not self._copied:
            self._copy_policy()
        return _forward_logps(self.parts[0], microbatch)


@contextlib.contextmanager
def adapters_disabled(parts: list[nn.Module]) -> Iterator[None]:
    """The LoRA linears of `parts` compute their base alone (scaling 0) inside the block."""
    linears = [m for part in parts for m in part.modules() if isinstance(m, LoRALinear)]
    scalings = [m.scaling for m in linears]
    for m in linears:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in zip(linears, scalings):
            m.scaling = scaling


class AdaptersOff:
    """The policy's base: the LoRA run's model with its adapters disabled."""

    def __init__(self, policy: list[nn.Module]):
        self.policy = policy

    def logps(self, microbatch: Microbatch) -> torch.Tensor:
        with adapters_disabled(self.policy):
            return _forward_logps(self.policy[0], microbatch)
