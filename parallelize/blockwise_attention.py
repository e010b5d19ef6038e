"""Causal attention of a context-parallel rank's query chunks over the whole sequence's keys, block by block.

Under context parallel a rank's queries are one or two chunks of the sequence (chunk ``c`` of ``2 cp`` under
head-tail load balancing), and the keys and values of every chunk are gathered in position order. A query chunk
``c`` attends to all keys of the chunks before it and causally to its own chunk's keys, so its attention is two
calls of the fused attention kernel, neither with a mask: the earlier keys unmasked, its own chunk with
``is_causal``. Their softmaxes are merged by their log-sum-exps (ring attention's arithmetic): with
``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``. Later chunks are
skipped, so every rank does exactly its share of causal attention work, and nothing of size [queries, keys] is ever
kept: backward calls the kernel's backward per call with the merged output and log-sum-exp, which gives each call's
exact share of the gradient (the fused kernels recompute their probabilities from the log-sum-exp they are given).

The kernels are torch's CPU flash-attention ops (``_scaled_dot_product_flash_attention_for_cpu`` and its backward),
the ones ``F.scaled_dot_product_attention`` runs on CPU; they exist on CPU only (see context_parallel.py for CUDA).
"""

from __future__ import annotations

import math

import torch

_attend = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_attend_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over two disjoint key sets from each one's output and log-sum-exp (fp32 arithmetic)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a.float() * torch.exp(lse_a - lse).unsqueeze(-1) + out_b.float() * torch.exp(lse_b - lse).unsqueeze(-1)
    return out.to(out_a.dtype), lse


def _repeat_heads(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, kv_heads, s, d] -> [b, kv_heads * n_rep, s, d]``, query head h on kv head h // n_rep (as repeat_kv)."""
    if n_rep == 1:
        return x
    b, kv_heads, s, d = x.shape
    return x[:, :, None].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)


def _sum_heads(grad: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The gradient of `_repeat_heads`: each kv head's share summed over the query heads it served."""
    if n_rep == 1:
        return grad
    b, heads, s, d = grad.shape
    return grad.view(b, heads // n_rep, n_rep, s, d).sum(dim=2)


class BlockCausalAttention(torch.autograd.Function):
    """``q [b, heads, n * chunk, d]``: this rank's n chunks, chunk j being chunk ``blocks[j]`` of the sequence;
    ``k``, ``v [b, kv_heads, seq, d]``: the whole sequence in position order, in chunks of the same length.

    Keys and values are kept for backward with their kv heads only (grouped-query attention: ``heads / kv_heads``
    times less than the repeated ones the kernel reads, which are rebuilt where needed).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: tuple[int, ...]) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        k_grouped, v_grouped = k, v
        k, v = _repeat_heads(k, n_rep), _repeat_heads(v, n_rep)
        chunk = q.shape[2] // len(blocks)
        scale = 1.0 / math.sqrt(q.shape[-1])
        outs, lses = [], []
        for j, c in enumerate(blocks):
            q_c = q[:, :, j * chunk : (j + 1) * chunk]
            own = slice(c * chunk, (c + 1) * chunk)
            out, lse = _attend(q_c, k[:, :, own], v[:, :, own], 0.0, True, scale=scale)
            if c > 0:
                earlier = slice(0, c * chunk)
                earlier_out, earlier_lse = _attend(q_c, k[:, :, earlier], v[:, :, earlier], 0.0, False, scale=scale)
                out, lse = _merge(out, lse, earlier_out, earlier_lse)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k_grouped, v_grouped, out, lse)
        ctx.blocks, ctx.scale, ctx.n_rep = blocks, scale, n_rep
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k_grouped, v_grouped, out, lse = ctx.saved_tensors
        k, v = _repeat_heads(k_grouped, ctx.n_rep), _repeat_heads(v_grouped, ctx.n_rep)
        grad_out = grad_out.contiguous()
        chunk = q.shape[2] // len(ctx.blocks)
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        grad_k = torch.zeros_like(k, dtype=torch.float32)
        grad_v = torch.zeros_like(v, dtype=torch.float32)
        for j, c in enumerate(ctx.blocks):
            rows = slice(j * chunk, (j + 1) * chunk)
            q_c, out_c, lse_c, grad_c = q[:, :, rows], out[:, :, rows], lse[:, :, rows], grad_out[:, :, rows]
            for keys, causal in ((slice(c * chunk, (c + 1) * chunk), True), (slice(0, c * chunk), False)):
                if keys.stop == 0:
                    continue
                dq, dk, dv = _attend_backward(
                    grad_c, q_c, k[:, :, keys], v[:, :, keys], out_c, lse_c, 0.0, causal, scale=ctx.scale
                )
                grad_q[:, :, rows] += dq
                grad_k[:, :, keys] += dk
                grad_v[:, :, keys] += dv
        grad_k, grad_v = _sum_heads(grad_k, ctx.n_rep), _sum_heads(grad_v, ctx.n_rep)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None
