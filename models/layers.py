"""The layers and initialisation rules that decoder families share: RMSNorm, the SwiGLU feed-forward and
torchtitan 0.2.2's truncated-normal inits.

Families build on these (models/transformer.py, models/moe.py, models/deepseek_v3/) rather than on one another,
so no family's module is another's dependency.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BASE_INIT_STD = 0.02
# torchtitan truncates the hidden weights at torch's default bounds, absolute values, not multiples of the std.
TRUNCATION_BOUND = 2.0
# ... and the head at 3 of its std.
HEAD_TRUNCATION_STDS = 3.0


def trunc_normal_init_(weight: torch.Tensor, std: float) -> None:
    """A normal of `std` truncated at the absolute bound +-2, in place (a hidden weight's init)."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-TRUNCATION_BOUND, b=TRUNCATION_BOUND)


def head_init_(weight: torch.Tensor, dim: int) -> None:
    """The output head's init, in place: std ``dim ** -0.5`` truncated at 3 std."""
    std = dim**-0.5
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-HEAD_TRUNCATION_STDS * std, b=HEAD_TRUNCATION_STDS * std)


def depth_scaled_init_std(layer_id: int) -> float:
    """Init std of the projections that write into the residual stream in block ``layer_id``."""
    return BASE_INIT_STD / math.sqrt(2 * (layer_id + 1))


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and no bias; statistics are taken in float32.

    ``eps`` None is the machine epsilon of the input's dtype, as ``torch.nn.RMSNorm`` takes it (torchtitan builds
    DeepSeek-V3's final norm so).
    """

    def __init__(self, dim: int, eps: float | None = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, out_std: float) -> None:
        trunc_normal_init_(self.w1.weight, BASE_INIT_STD)
        trunc_normal_init_(self.w2.weight, out_std)
        trunc_normal_init_(self.w3.weight, out_std)
