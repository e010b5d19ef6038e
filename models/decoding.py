"""Autoregressive generation from any family's model on one device: a prompt, then one token at a time from the
KV cache (``models/kv_cache.py``), each chosen greedily or sampled (temperature, then top-k, then top-p: the order
Hugging Face's ``generate`` applies them in, so that the same settings mean the same thing)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .kv_cache import kv_cache

# The smallest temperature that sampling accepts: the smallest normal float32. The logits are scaled as
# (logits - row max) / temperature, so every scaled logit is <= 0 and the row max is exactly 0: softmax's exp never
# overflows and its sum is >= 1, whatever the temperature, as long as the temperature is a nonzero float32. Below
# this bound it would round to a subnormal or to 0, and 0 / 0 is NaN. (Any temperature this small is greedy
# decoding in effect; 0 asks for greedy directly.)
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits. ``temperature`` 0 is greedy (the other fields are unused);
    ``top_k`` 0 and ``top_p`` 1.0 keep every token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        # Written so that NaN fails every test (each comparison with NaN is false).
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:.3g} (the smallest normal "
                f"float32), got {self.temperature}"
            )
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p}")

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The next token of each row of ``logits [batch, vocab]``: ``[batch]`` ids."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits.float()
        # The max subtracted first, so that a small temperature drives the others to -inf, never the max to inf.
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / self.temperature
        if self.top_k > 0:
            kth_largest = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        if self.top_p < 1:
            logits = _keep_top_p(logits, self.top_p)
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _keep_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask all but the smallest set of most likely tokens whose probabilities sum to at least ``top_p``."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # A token is dropped when the more likely ones before it already reach top_p; the most likely always stays.
    drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The new tokens ``[batch, n <= max_new_tokens]`` that follow ``prompt [batch, P]``.

    The model is called as ``model(tokens, positions)`` and must return logits ``[batch, seq, vocab]``. Generation
    stops early once every row has produced one of ``eos_ids`` (the EOS is kept; a finished row repeats it, as
    Hugging Face does when no pad token is set). With ``vocab_size`` (the tokenizer's), ids at or above it are never
    chosen: the embedding's padding rows past the tokenizer's vocabulary decode to nothing. ``on_token`` gets each
    step's ``[batch]`` tokens as they are chosen (a chat streams them).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    bsz, prompt_len = prompt.shape
    device = prompt.device
    eos = torch.tensor(eos_ids, dtype=prompt.dtype, device=device)
    finished = torch.zeros(bsz, dtype=torch.bool, device=device)
    new_tokens = []
    with kv_cache(model, prompt_len + max_new_tokens - 1):
        logits = model(prompt, torch.arange(prompt_len, device=device))[:, -1]
        for i in range(max_new_tokens):
            if vocab_size is not None:
                logits[:, vocab_size:] = float("-inf")  # the model's own output: nothing else reads it
            token = sampling.choose(logits, generator)
            if eos_ids:
                token = torch.where(finished, eos[0], token)
                finished |= torch.isin(token, eos)
            new_tokens.append(token)
            if on_token is not None:
                on_token(token)
            # One host sync per token for the early stop; generation is latency-bound on it anyway.
            if i + 1 == max_new_tokens or (eos_ids and bool(finished.all())):
                break
            position = torch.tensor([prompt_len + i], device=device)
            logits = model(token[:, None], position)[:, -1]
    return torch.stack(new_tokens, dim=1)
