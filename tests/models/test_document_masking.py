"""Document masking at the attention seam: with ``document_ids`` a token attends only to earlier tokens of its own
document, for every family; without them (or with one document) attention is the plain causal one."""

from __future__ import annotations

import pytest
import torch

from dtrain.models.attention import CausalSDPA
from dtrain.models.kv_cache import kv_cache
from dtrain.models.llama3 import Transformer
from dtrain.models.qwen3 import Qwen3Args, Qwen3Transformer

QWEN3_TINY = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=96, vocab_size=128,
                       max_seq_len=32)
# Two sequences of 16 tokens: the first holds documents 0 (tokens 0-5) and 1 (6-15), the second 0 (0-9) and 1.
DOCUMENT_IDS = torch.tensor([[0] * 6 + [1] * 10, [0] * 10 + [1] * 6])


@pytest.fixture(params=["llama3", "qwen3"])
def model(request, tiny_args) -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(tiny_args) if request.param == "llama3" else Qwen3Transformer(QWEN3_TINY)


def _tokens(batch=2, seqlen=16, seed=0):
    return torch.randint(0, 128, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_a_document_does_not_see_the_one_before_it(model):
    tokens = _tokens()
    first_document = DOCUMENT_IDS == 0
    changed = torch.where(first_document, (tokens + 1) % 128, tokens)
    masked = model(tokens, document_ids=DOCUMENT_IDS), model(changed, document_ids=DOCUMENT_IDS)
    torch.testing.assert_close(masked[1][~first_document], masked[0][~first_document], atol=1e-6, rtol=1e-6)
    # Plain causal attention reads the first document from the second: the same change moves its logits.
    causal = model(tokens), model(changed)
    assert (causal[1][~first_document] - causal[0][~first_document]).abs().amax(dim=-1).min() > 1e-4


@torch.no_grad()
def test_one_document_is_causal_attention(model):
    tokens = _tokens()
    one_document = torch.ones_like(tokens)
    torch.testing.assert_close(model(tokens, document_ids=one_document), model(tokens), atol=1e-5, rtol=1e-5)


def _qkv(seqlen=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen, 4, 16, generator=generator)
    k, v = torch.randn(2, 2, seqlen, 2, 16, generator=generator)  # grouped: 2 kv heads for 4 query heads
    return q, k, v


def test_causal_sdpa_with_one_document_equals_its_causal_path():
    q, k, v = _qkv()
    positions = torch.arange(16)
    expected = CausalSDPA()(q, k, v, positions)
    torch.testing.assert_close(CausalSDPA()(q, k, v, positions, torch.ones(2, 16, dtype=torch.long)), expected)


def test_causal_sdpa_attends_each_document_as_its_own_sequence():
    q, k, v = _qkv()
    attention = CausalSDPA()
    out = attention(q, k, v, torch.arange(16), DOCUMENT_IDS)
    for row in range(2):
        for doc in (0, 1):
            span = (DOCUMENT_IDS[row] == doc).nonzero().squeeze(1)
            alone = attention(q[row : row + 1, span], k[row : row + 1, span], v[row : row + 1, span], span)
            torch.testing.assert_close(out[row : row + 1, span], alone, atol=1e-6, rtol=1e-6)


def test_the_model_hands_document_ids_to_the_inner_attention(tiny_args):
    # Positionally, after the positions: plans rewrite attention's positional inputs (context parallel's hook).
    model = Transformer(tiny_args)
    seen = []

    class Recording(torch.nn.Module):
        def forward(self, q, k, v, positions, document_ids):
            seen.append(document_ids)
            return CausalSDPA()(q, k, v, positions, document_ids)

    for block in model.layers.values():
        block.attention.inner_attention = Recording()
    model(_tokens(), document_ids=DOCUMENT_IDS)
    assert len(seen) == tiny_args.n_layers and all(ids is DOCUMENT_IDS for ids in seen)
    model(_tokens())
    assert seen[-1] is None


@torch.no_grad()
def test_generation_refuses_document_ids(tiny_args):
    model = Transformer(tiny_args)
    with kv_cache(model, 16), pytest.raises(ValueError, match="generation is causal"):
        model(_tokens(), torch.arange(16), DOCUMENT_IDS)
