"""Document masking through FlexAttention block masks equals the dense block-causal mask: the forward on CPU (where
FlexAttention has no backward), forward and backward on CUDA; and where the trainer takes which path."""

from __future__ import annotations

import pytest
import torch

from dtrain.models.attention import CausalSDPA
from dtrain.models.flex_attention import FlexDocumentAttention, use_flex_document_attention
from dtrain.models.llama3 import Transformer
from dtrain.parallelize import ParallelDims, ParallelismError, ParallelizeOptions

SEQ = 256  # two 128-token tiles per side: empty, full and partial tiles all occur


def packed_documents(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    """``[batch, seq]`` document ids of packed windows with several documents each, one crossing a tile edge."""
    lengths = [[40, 100, 90, 26], [130, 7, 119]]
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths[:batch]])


def _qkv(device="cpu", dtype=torch.float32, seed=0):
    generator = torch.Generator(device).manual_seed(seed)
    q = torch.randn(2, SEQ, 4, 16, generator=generator, device=device, dtype=dtype)
    k, v = torch.randn(2, 2, SEQ, 2, 16, generator=generator, device=device, dtype=dtype)  # 2 kv heads for 4
    return q, k, v


@torch.no_grad()
def test_flex_forward_equals_the_dense_mask_on_cpu():
    q, k, v = _qkv()
    positions, documents = torch.arange(SEQ), packed_documents()
    dense = CausalSDPA()(q, k, v, positions, documents)
    torch.testing.assert_close(FlexDocumentAttention()(q, k, v, positions, documents), dense, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_model_with_flex_attention_gives_the_dense_models_logits(tiny_args):
    tiny_args.max_seq_len = SEQ
    torch.manual_seed(0)
    dense = Transformer(tiny_args)
    flex = Transformer(tiny_args)
    flex.load_state_dict(dense.state_dict())
    use_flex_document_attention(flex)
    assert all(isinstance(block.attention.inner_attention, FlexDocumentAttention) for block in flex.layers.values())
    tokens = torch.randint(0, tiny_args.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    documents = packed_documents()
    torch.testing.assert_close(flex(tokens, document_ids=documents), dense(tokens, document_ids=documents),
                               rtol=1e-5, atol=1e-5)
    # Without documents it is the plain causal attention.
    torch.testing.assert_close(flex(tokens), dense(tokens), rtol=0, atol=0)


@pytest.mark.parametrize(
    "device_type, backend, mask, flex",
    [
        ("cuda", "auto", "block_causal", True),
        ("cpu", "auto", "block_causal", False),
        ("cuda", "dense", "block_causal", False),
        ("cuda", "flex", "causal", False),  # nothing to mask: the fused causal kernels
    ],
)
def test_auto_takes_flex_on_cuda_and_the_dense_mask_elsewhere(device_type, backend, mask, flex):
    options = ParallelizeOptions(device_type=device_type, attention_mask=mask, attention_mask_backend=backend)
    assert options.flex_attention is flex
    assert options.cp_attention_path == ("flex" if flex else "masked" if mask == "block_causal" else "ring")


def test_flex_off_cuda_is_refused_naming_the_key():
    options = ParallelizeOptions(device_type="cpu", attention_mask="block_causal", attention_mask_backend="flex")
    with pytest.raises(ParallelismError, match=r"training.attention_mask_backend='flex' needs CUDA.*valid here: auto"):
        options.validate(ParallelDims(dp_shard=1, world_size=1))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_flex_forward_and_backward_equal_the_dense_mask_on_cuda(dtype, tolerance):
    """The compiled Triton kernel against SDPA with the dense mask: outputs and q/k/v gradients (bf16: its
    rounding)."""
    positions, documents = torch.arange(SEQ, device="cuda"), packed_documents().cuda()
    results = []
    for attention in (FlexDocumentAttention(), CausalSDPA()):
        q, k, v = (t.requires_grad_() for t in _qkv("cuda", dtype))
        out = attention(q, k, v, positions, documents)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for got, want in zip(*results):
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
