"""The single-device Mixture-of-Experts feed-forward layer: token-choice top-k routing over SwiGLU experts, with
optional shared experts, group-limited routing, an auxiliary load-balancing loss and DeepSeek-V3's loss-free
balancing bias.

Routing reproduces Hugging Face's Qwen3-MoE (softmax) and DeepSeek-V3 (sigmoid, selection-only bias, group-limited
top-k, routed scaling) exactly; names are torchtitan's (docs/models.md, "Mixture of experts" and "Parameter
names"). Expert parallel is applied from outside by hooks on the ``experts`` submodule, so every token reaches
the experts through one call ``self.experts(routed_input, num_tokens_per_expert)`` (rows grouped by expert), and
``GroupedExperts`` takes its expert count from its weights, never the args. The auxiliary loss's statistics span
the whole data-parallel microbatch through ``reduce_expert_counts``, which parallelize sets to a sum over those
ranks (docs/parallelism.md, "Expert parallel"). The forward has no host sync and no data-dependent control flow,
so ``torch.compile`` captures it whole, except the per-expert fallback loop used where ``torch._grouped_mm`` does
not run (``_grouped_mm_runs``), which reads the counts on the host.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import FeedForward, trunc_normal_init_

SCORE_FUNCS = ("softmax", "sigmoid")
# Hugging Face's DeepSeek-V3 adds this to the renormalisation denominator. For softmax scores the top-k sum is at
# least 1/E, where adding it changes nothing in float32, so one formula reproduces Qwen3-MoE exactly as well.
ROUTE_NORM_EPS = 1e-20
# On the CPU, torch._grouped_mm is a C++ loop of one matmul per expert: bitwise equal to the Python loop below
# (forward and backward, torch 2.11 and 2.13), without its per-expert Python overhead and its host sync.
CPU_EAGER_GROUPED_MM_DTYPES = (torch.float32, torch.float16)


@dataclass
class MoEArgs:
    """The shape and routing of one MoE layer (a family's args carry it as ``moe``)."""

    num_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 1408  # each routed expert's SwiGLU width (HF moe_intermediate_size)
    num_shared_experts: int = 0  # shared experts, as one SwiGLU of width hidden_dim * num_shared_experts
    score_func: str = "softmax"  # "softmax" (Qwen3-MoE) | "sigmoid" (DeepSeek-V3)
    route_norm: bool = False  # renormalise the k selected scores to sum to 1 (HF norm_topk_prob)
    route_scale: float = 1.0  # multiply the combine weights (HF routed_scaling_factor)
    num_expert_groups: int = 1  # group-limited routing (DeepSeek-V3 n_group) ...
    num_limited_groups: int = 1  # ... each token picks experts only within its best groups (HF topk_group)
    aux_loss_coeff: float = 0.0  # auxiliary load-balancing loss weight; 0: none
    load_balance_bias: bool = False  # DeepSeek-V3's loss-free balancing: a per-expert bias for selection only
    bias_update_speed: float = 1e-3  # step size of that bias per update

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.hidden_dim < 1:
            raise ValueError(f"hidden_dim must be >= 1, got {self.hidden_dim}")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {self.score_func!r}")
        if self.route_scale <= 0:
            raise ValueError(f"route_scale must be > 0, got {self.route_scale}")
        if self.num_expert_groups < 1 or self.num_experts % self.num_expert_groups:
            raise ValueError(
                f"num_expert_groups must divide num_experts={self.num_experts}, got {self.num_expert_groups}"
            )
        if self.num_expert_groups > 1 and self.num_experts // self.num_expert_groups < 2:
            raise ValueError(f"num_expert_groups={self.num_expert_groups} leaves fewer than 2 experts per group "
                             "(a group's score is the sum of its top 2)")
        if not 1 <= self.num_limited_groups <= self.num_expert_groups:
            raise ValueError(f"num_limited_groups must be in [1, num_expert_groups={self.num_expert_groups}], "
                             f"got {self.num_limited_groups}")
        reachable = self.num_limited_groups * (self.num_experts // self.num_expert_groups)
        if self.top_k > reachable:
            raise ValueError(f"top_k={self.top_k} exceeds the {reachable} experts of num_limited_groups="
                             f"{self.num_limited_groups} groups")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")
        if self.bias_update_speed < 0:
            raise ValueError(f"bias_update_speed must be >= 0, got {self.bias_update_speed}")


def _grouped_mm_runs(x: torch.Tensor, hidden_dim: int) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``x`` (torch 2.11 and 2.13): bf16 on Hopper or newer GPUs and on the
    CPU (and meta); float32 and fp16 on the CPU too, but only eagerly, because the op's fake-tensor rule (used
    by ``torch.compile`` and the meta device) accepts bf16 alone. Every row stride must be a multiple of 16 bytes."""
    if any(size * x.element_size() % 16 for size in (x.shape[-1], hidden_dim)):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.dtype == torch.bfloat16:
        return x.device.type in ("cpu", "meta")
    return x.device.type == "cpu" and x.dtype in CPU_EAGER_GROUPED_MM_DTYPES and not torch.compiler.is_compiling()


def _autocast_enabled(x: torch.Tensor) -> bool:
    # The meta device has no autocast to ask about (torch.amp.is_autocast_available is not traceable in torch 2.11).
    return x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)


def _autocast_disabled(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on ``x``'s device (devices without autocast, such as meta, need nothing)."""
    return torch.autocast(x.device.type, enabled=False) if _autocast_enabled(x) else contextlib.nullcontext()


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts applied to rows grouped by expert: ``w2[e](silu(w1[e] x) * w3[e] x)``."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x [T, dim]``, its rows grouped by expert in expert order, ``num_tokens_per_expert [E_local]`` (int64,
        summing to T) -> ``[T, dim]`` in ``x``'s dtype."""
        return run_experts(x, num_tokens_per_expert, *self.weights())

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w1, w2, w3)``, in ``run_experts``'s order."""
        return self.w1, self.w2, self.w3

    def init_weights(self, init_std: float, out_std: float) -> None:
        trunc_normal_init_(self.w1, init_std)
        trunc_normal_init_(self.w2, out_std)
        trunc_normal_init_(self.w3, out_std)


def run_experts(
    x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The experts' math on given weights (``[E, hidden, dim]``, ``[E, dim, hidden]``, ``[E, hidden, dim]``), so that
    expert parallelism can run it on this rank's local shard of the weights: grouped GEMMs where ``torch._grouped_mm``
    runs, else the per-expert loop. The number of experts is ``len(w1)``. Computes in ``x``'s dtype, or in the
    autocast dtype where autocast is on (which would not cast ``torch._grouped_mm`` itself)."""
    dtype = torch.get_autocast_dtype(x.device.type) if _autocast_enabled(x) else x.dtype
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    if _grouped_mm_runs(x, w1.shape[1]):
        return _experts_grouped_mm(x, num_tokens_per_expert, w1, w2, w3)
    return _experts_loop(x, num_tokens_per_expert, w1, w2, w3)


def _experts_grouped_mm(
    x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    # The group ends stay on the device: no host sync, and one kernel per projection for all experts.
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)


def _experts_loop(
    x: torch.Tensor, num_tokens_per_expert: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    # .tolist() is a host sync (and a graph break under torch.compile): the price of this exact, portable fallback.
    outputs = [
        (F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T
        for e, rows in enumerate(torch.split(x, num_tokens_per_expert.tolist()))
    ]
    return torch.cat(outputs)


class TokenChoiceTopKRouter(nn.Module):
    """Scores every expert for every token (in float32) and picks each token's ``top_k``."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.num_expert_groups = args.num_expert_groups
        self.num_limited_groups = args.num_limited_groups

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, dim]`` -> ``(top_scores [T, k] float32 combine weights, selected_experts [T, k] int64,
        scores [T, E] float32)``; ``expert_bias`` shifts the scores used to select, never the combine weights."""
        return self.route(x, self.gate.weight, expert_bias)

    def route(
        self, x: torch.Tensor, gate_weight: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routing with a given gate weight, so that tensor parallelism can run it on the local tensor of a
        replicated weight (as ``run_experts`` for the experts)."""
        # Selection is sensitive to rounding: the gate runs in float32, under autocast too.
        with _autocast_disabled(x):
            logits = F.linear(x.float(), gate_weight.float())
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        scores_for_choice = scores if expert_bias is None else scores + expert_bias
        if self.num_expert_groups > 1:
            scores_for_choice = self._mask_unchosen_groups(scores_for_choice)
        selected_experts = scores_for_choice.topk(self.top_k, dim=-1).indices
        top_scores = scores.gather(1, selected_experts)
        if self.route_norm:
            top_scores = top_scores / (top_scores.sum(dim=-1, keepdim=True) + ROUTE_NORM_EPS)
        return top_scores * self.route_scale, selected_experts, scores

    def _mask_unchosen_groups(self, scores_for_choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited routing, as Hugging Face's: a group scores the sum of its top 2 experts, and
        experts outside a token's best ``num_limited_groups`` groups get -inf so they are never selected."""
        grouped = scores_for_choice.unflatten(-1, (self.num_expert_groups, -1))
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(self.num_limited_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        return grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).flatten(1)


def counts_of_this_process(counts: torch.Tensor) -> torch.Tensor:
    """``MoE.reduce_expert_counts`` of a single process: the tokens it routes are the whole microbatch."""
    return counts


class MoE(nn.Module):
    """Routed experts (plus shared experts): ``x [B, S, dim] -> [B, S, dim]`` in ``x``'s dtype.

    Training with ``aux_loss_coeff > 0`` leaves this process's share of the layer's load-balancing loss in
    ``self.aux_loss`` (a float32 scalar with gradient to the gate; None otherwise) for the trainer to add to the
    objective; the shares of the ranks that route one microbatch together sum to that microbatch's loss.
    """

    def __init__(self, args: MoEArgs, dim: int) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.num_experts = args.num_experts
        self.aux_loss_coeff = args.aux_loss_coeff
        self.bias_update_speed = args.bias_update_speed
        self.router = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(dim, args.hidden_dim, args.num_experts)
        self.shared_experts = (
            FeedForward(dim, args.hidden_dim * args.num_shared_experts) if args.num_shared_experts > 0 else None
        )
        if args.load_balance_bias:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        else:
            self.expert_bias = None
        # Summed over the steps since the last update_expert_bias (or over a logging interval): the load per expert.
        self.register_buffer(
            "tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32), persistent=False
        )
        self.aux_loss: torch.Tensor | None = None
        # Per-expert counts of this process -> of the whole data-parallel microbatch (set by parallelize).
        self.reduce_expert_counts = counts_of_this_process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = x.shape[-1]
        tokens = x.reshape(-1, dim)
        top_scores, selected_experts, scores = self.router(tokens, self.expert_bias)

        # Order the T*k (token, slot) pairs by expert; stable, so each expert sees its tokens in token order.
        flat_experts = selected_experts.flatten()
        order = torch.argsort(flat_experts, stable=True)
        expert_ids = torch.arange(self.num_experts + 1, device=x.device, dtype=flat_experts.dtype)
        group_starts = torch.searchsorted(flat_experts[order], expert_ids)
        num_tokens_per_expert = group_starts.diff()  # counts from the sorted ids: no bincount, no host sync
        with torch.no_grad():
            self.tokens_per_expert += num_tokens_per_expert.float()

        # Gather through a permutation of the expanded (token, slot) rows, not by token index with repeats: the
        # backward then writes each row once, deterministic on every device, and sums over k as a reduction.
        pair_rows = tokens.unsqueeze(1).expand(-1, self.top_k, -1).reshape(-1, dim)
        routed_output = self.experts(pair_rows[order], num_tokens_per_expert)

        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        pair_output = routed_output[inverse].view(-1, self.top_k, dim)
        out = (pair_output * top_scores.unsqueeze(-1).to(pair_output.dtype)).sum(dim=1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)

        self.aux_loss = (
            self._load_balancing_loss(num_tokens_per_expert, scores)
            if self.training and self.aux_loss_coeff > 0
            else None
        )
        return out.to(x.dtype).view(x.shape)

    def _load_balancing_loss(self, num_tokens_per_expert: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's ``coeff * E * sum_i f_i * P_i`` per layer, with Hugging Face Qwen3-MoE's
        normalisation (its ``router_aux_loss_coef`` carries over): f_i the selections of expert i per token (they
        sum to top_k over the experts), P_i its mean router probability, both over the N tokens of the whole
        data-parallel microbatch. The trainer averages the layers' terms, where Hugging Face pools the layers'
        statistics into one term (equal when every layer routes alike).

        f_i is a count (no gradient), summed over the ranks by ``reduce_expert_counts``; P_i is a sum over tokens,
        so this process's share is its own tokens' probabilities over the global N. The shares then add up over
        the ranks to the loss, and their gradients (summed by data parallel) to its gradient, exactly."""
        with torch.no_grad():
            counts = self.reduce_expert_counts(num_tokens_per_expert.float())
            # Each token selects top_k distinct experts: the counts sum to N * top_k.
            tokens = counts.sum() / self.top_k
        selection_fraction = counts / tokens
        probability_share = scores.sum(dim=0) / tokens
        return self.aux_loss_coeff * self.num_experts * (selection_fraction * probability_share).sum()

    def init_weights(self, init_std: float, out_std: float) -> None:
        """``init_std`` for the experts' input projections (w1), ``out_std`` (the block's depth-scaled std) for
        everything else here, the router's gate included, as torchtitan 0.2.2 initialises its MoE."""
        with torch.no_grad():
            trunc_normal_init_(self.router.gate.weight, out_std)
            self.experts.init_weights(init_std, out_std)
            if self.shared_experts is not None:
                self.shared_experts.init_weights(out_std)
            if self.expert_bias is not None:
                self.expert_bias.zero_()
            self.tokens_per_expert.zero_()


def update_expert_bias(moe: MoE, tokens_per_expert: torch.Tensor) -> None:
    """DeepSeek-V3's loss-free balancing, after an optimizer step: ``expert_bias += bias_update_speed *
    sign(mean_load - load)`` (underloaded experts become likelier picks), less the mean of that change as torchtitan
    does (the choice of experts is the same either way; the bias values then equal torchtitan's, checkpoints
    included), then ``moe.tokens_per_expert`` is zeroed.

    ``tokens_per_expert`` is the load, already summed over all data-parallel ranks by the caller. Only signs
    matter, so activation-checkpoint recomputation of the router, which doubles every count, changes nothing.
    No host sync.
    """
    if moe.expert_bias is None:
        raise ValueError("load_balance_bias is off: this MoE layer has no expert_bias to update")
    with torch.no_grad():
        load = tokens_per_expert.float()
        delta = moe.bias_update_speed * torch.sign(load.mean() - load)
        moe.expert_bias += delta - delta.mean()
        moe.tokens_per_expert.zero_()


def moe_params_per_token(args: MoEArgs, dim: int) -> int:
    """Matmul parameters one token goes through in one MoE layer: the gate, its ``top_k`` routed experts and the
    shared experts. For counting FLOPs by active parameters (so MFU counts only what a token computes)."""
    gate = dim * args.num_experts
    routed = args.top_k * 3 * dim * args.hidden_dim
    shared = 3 * dim * args.hidden_dim * args.num_shared_experts
    return gate + routed + shared
