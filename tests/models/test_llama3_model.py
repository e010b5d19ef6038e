"""The Llama 3 transformer: shapes, init, abstract (meta) init, causality, GQA, weight tying, pipeline stages."""

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dtrain.models import count_params
from dtrain.models.llama3 import Transformer, rope_frequencies


def _seeded_init(model: Transformer, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model.init_weights()
    return model


def _tokens(args, batch=2, seqlen=16, seed=123):
    return torch.randint(0, args.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def test_parameter_names_are_torchtitans(tiny_args):
    names = set(Transformer(tiny_args).state_dict())
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(tiny_args.n_layers):
        expected |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        expected |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    assert names == expected  # no biases, and the RoPE table is not persistent


def test_forward_shapes(tiny_args):
    model = Transformer(tiny_args)
    logits = model(_tokens(tiny_args, batch=3, seqlen=tiny_args.max_seq_len))
    assert logits.shape == (3, tiny_args.max_seq_len, tiny_args.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert model.layers["1"].attention.wk.weight.shape == (2 * 16, 64)  # n_kv_heads * head_dim


def test_too_long_sequence_names_max_seq_len(tiny_args):
    model = Transformer(tiny_args)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(tiny_args, batch=1, seqlen=tiny_args.max_seq_len + 1))


def test_inner_attention_is_a_swappable_seam_called_with_positions(tiny_args):
    # A plan replaces attention's inner module (context parallel, document masking); it sees the rotated
    # queries, the grouped (not repeated) keys and values, and the positions the model was called with.
    model = Transformer(tiny_args)
    tokens = _tokens(tiny_args, batch=2, seqlen=8)
    expected = model(tokens)
    seen = []

    class Recording(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, q, k, v, positions, document_ids):
            seen.append((q.shape[2], k.shape[2], positions.tolist()))
            return self.inner(q, k, v, positions, document_ids)

    for block in model.layers.values():
        block.attention.inner_attention = Recording(block.attention.inner_attention)
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)
    assert seen[0] == (tiny_args.n_heads, tiny_args.n_kv_heads, list(range(8)))
    model(tokens, positions=torch.arange(8) + 3)
    assert seen[-1][2] == list(range(3, 11))


def test_same_seed_same_init_different_seed_different(tiny_args):
    a = _seeded_init(Transformer(tiny_args), 7).state_dict()
    b = _seeded_init(Transformer(tiny_args), 7).state_dict()
    c = _seeded_init(Transformer(tiny_args), 8).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])
    assert not torch.equal(a["output.weight"], c["output.weight"])


def test_meta_to_empty_init_equals_real_device_init(tiny_args):
    real = _seeded_init(Transformer(tiny_args), 3)
    with torch.device("meta"):
        abstract = Transformer(tiny_args)
    assert abstract.rope_cache.is_meta and all(p.is_meta for p in abstract.parameters())
    abstract.to_empty(device="cpu")
    _seeded_init(abstract, 3)
    for (name, p_real), (_, p_abstract) in zip(real.named_parameters(), abstract.named_parameters()):
        torch.testing.assert_close(p_abstract, p_real, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(abstract.rope_cache, real.rope_cache, atol=0, rtol=0)
    tokens = _tokens(tiny_args)
    torch.testing.assert_close(abstract(tokens), real(tokens), atol=0, rtol=0)


def test_init_scheme(tiny_args):
    # torchtitan 0.2.2's (tests/reference/test_torchtitan_init.py compares with its own init): the embedding a plain
    # normal, the head truncated at 3 std, every other weight truncated only at +-2 (torch's default bounds).
    args = replace(tiny_args, dim=64, vocab_size=512, n_layers=4)
    model = _seeded_init(Transformer(args), 0)
    layer_out_std = [0.02 / math.sqrt(2 * (i + 1)) for i in range(args.n_layers)]
    expected = {"tok_embeddings.weight": (1.0, None), "output.weight": (args.dim**-0.5, 3), "norm.weight": None}
    for i, out_std in enumerate(layer_out_std):
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
            expected[f"layers.{i}.{name}.weight"] = (0.02, None)
        for name in ("attention.wo", "feed_forward.w2", "feed_forward.w3"):
            expected[f"layers.{i}.{name}.weight"] = (out_std, None)
        expected[f"layers.{i}.attention_norm.weight"] = expected[f"layers.{i}.ffn_norm.weight"] = None
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    for name, law in expected.items():
        p = params[name].detach()
        if law is None:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        std, cut_stds = law
        if cut_stds is not None:
            assert p.abs().max() <= cut_stds * std + 1e-9, name
            # A normal truncated at 3 std has std 0.9865 * std.
            std *= 0.9865
        # With >= 2048 samples the estimate is within ~1.6% (1 sigma).
        assert abs(p.std().item() / std - 1) < 0.06, name
    # Not truncated at 3 std: among its 11k draws some lie beyond (a chance of 1e-13 that none does).
    assert params["layers.0.feed_forward.w1.weight"].abs().max() > 3 * 0.02


def test_tied_weight_takes_the_heads_init(tiny_args):
    model = _seeded_init(Transformer(replace(tiny_args, tie_word_embeddings=True)), 0)
    std = tiny_args.dim**-0.5
    assert model.tok_embeddings.weight.abs().max() <= 3 * std
    assert abs(model.tok_embeddings.weight.std().item() / (0.9865 * std) - 1) < 0.06


def test_causal_changing_a_token_leaves_earlier_logits_unchanged(tiny_args):
    model = Transformer(tiny_args)
    tokens = _tokens(tiny_args)
    changed = tokens.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % tiny_args.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], atol=1e-6, rtol=1e-6)
    assert (after[:, t:] - before[:, t:]).abs().amax(dim=-1).min() > 1e-6


def _reference_attention(attention, x, args):
    """Llama 3 attention written out per head: complex RoPE, query head h reads kv head h // (n_heads/n_kv_heads)."""
    bsz, seqlen, _ = x.shape
    hd = args.head_dim
    q = (x @ attention.wq.weight.T).view(bsz, seqlen, args.n_heads, hd)
    k = (x @ attention.wk.weight.T).view(bsz, seqlen, args.n_kv_heads, hd)
    v = (x @ attention.wv.weight.T).view(bsz, seqlen, args.n_kv_heads, hd)
    freqs = rope_frequencies(hd, args.rope_theta, args.rope_scaling)
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float32), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]

    def rope(t):
        return torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (hd // 2, 2))) * rotation).flatten(-2)

    q, k = rope(q), rope(k)
    group = args.n_heads // args.n_kv_heads
    mask = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    heads = []
    for h in range(args.n_heads):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(hd)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        heads.append(probs @ v[:, :, h // group])
    return torch.cat(heads, dim=-1) @ attention.wo.weight.T


def test_gqa_attention_matches_explicit_reference(tiny_args):
    assert tiny_args.n_kv_heads < tiny_args.n_heads
    model = Transformer(tiny_args)
    attention = model.layers["0"].attention
    x = torch.randn(2, 12, tiny_args.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = attention(x, model.rope_cache, torch.arange(12))
        expected = _reference_attention(attention, x, tiny_args)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_feed_forward_is_swiglu(tiny_args):
    ff = Transformer(tiny_args).layers["1"].feed_forward
    x = torch.randn(3, tiny_args.dim)
    expected = (F.silu(x @ ff.w1.weight.T) * (x @ ff.w3.weight.T)) @ ff.w2.weight.T
    torch.testing.assert_close(ff(x), expected, atol=1e-6, rtol=1e-5)


def test_weight_tying_shares_one_parameter(tiny_args):
    untied = Transformer(tiny_args)
    tied = Transformer(replace(tiny_args, tie_word_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert count_params(untied) - count_params(tied) == tiny_args.vocab_size * tiny_args.dim
    # The shared table is still the head's matmul weight, so excluding "the embedding" keeps it.
    assert count_params(tied, exclude_embedding=True) == count_params(tied)
    assert count_params(untied, exclude_embedding=True) == count_params(tied)
    tied(_tokens(tiny_args)).sum().backward()
    assert tied.tok_embeddings.weight.grad is not None and tied.tok_embeddings.weight.grad.abs().sum() > 0


def test_weight_tying_survives_meta_to_empty(tiny_args):
    args = replace(tiny_args, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    _seeded_init(model, 0)
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(model.state_dict()) - 1


def test_pipeline_stages_run_what_they_hold(tiny_args):
    args = replace(tiny_args, n_layers=3)
    full = _seeded_init(Transformer(args), 0)
    first, middle, last = (_seeded_init(Transformer(args), 0) for _ in range(3))
    del first.layers["1"], first.layers["2"]
    first.norm = first.output = None
    del middle.layers["0"], middle.layers["2"]
    middle.tok_embeddings = middle.norm = middle.output = None
    del last.layers["0"], last.layers["1"]
    last.tok_embeddings = None

    tokens = _tokens(args)
    hidden = first(tokens)
    assert hidden.shape == (2, 16, args.dim)
    hidden = middle(hidden)
    assert hidden.shape == (2, 16, args.dim)
    torch.testing.assert_close(last(hidden), full(tokens), atol=1e-5, rtol=1e-5)

    # A stage initialises only what it holds, and its blocks keep their depth-scaled std.
    _seeded_init(middle, 1)
    held = {name for name, _ in full.named_parameters() if name.startswith("layers.1.")}
    assert set(dict(middle.named_parameters())) == held


def test_block_init_is_depth_scaled(tiny_args):
    model = Transformer(replace(tiny_args, n_layers=8))
    torch.manual_seed(0)
    model.layers["7"].init_weights()
    assert model.layers["7"].attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)


def test_init_weights_places_rope_table_on_buffer_device(tiny_args):
    with torch.device("meta"):
        model = Transformer(tiny_args)
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    assert model.rope_cache.device.type == "cpu" and model.rope_cache.shape == (tiny_args.max_seq_len, 16)
    assert torch.isfinite(model.rope_cache).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_forward_backward_on_cuda(tiny_args):
    with torch.device("meta"):
        model = Transformer(tiny_args)
    model.to_empty(device="cuda")
    _seeded_init(model, 0)
    model = model.to(torch.bfloat16)
    logits = model(_tokens(tiny_args).cuda())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    logits.float().sum().backward()
