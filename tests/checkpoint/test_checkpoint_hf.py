"""Hugging Face interop for Llama 3: names, the RoPE row permutation, config.json, round trips, and (when
transformers is installed) logits of an exported model against LlamaForCausalLM."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from checkpoint_helpers import TINY_ARGS

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import load_hf_weights, safetensors_index, save_hf
from dtrain.models.llama3.hf_adapter import Llama3HFAdapter, halves_to_pairs, llama3_args_from_hf_config, pairs_to_halves
from dtrain.errors import DtrainError
from dtrain.models.llama3 import Transformer, apply_rotary_emb, precompute_rope_cache


def rotate_half_rope(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """HF's formulation: q * cos + rotate_half(q) * sin, with cos/sin repeated over both halves."""
    seqlen, head_dim = x.shape[1], x.shape[-1]
    cos, sin = rope_cache[:seqlen].view(1, seqlen, 1, head_dim).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], -1) * sin


def test_permuted_rows_give_hf_rope_the_same_scores():
    torch.manual_seed(0)
    n_heads, head_dim, dim, seqlen = 4, 16, 64, 8
    wq, wk = torch.randn(n_heads * head_dim, dim), torch.randn(n_heads * head_dim, dim)
    x = torch.randn(1, seqlen, dim)
    cache = precompute_rope_cache(head_dim, seqlen, 500000.0, TINY_ARGS.rope_scaling)

    def scores(q_rows, k_rows, rope):
        q = rope((x @ q_rows.T).view(1, seqlen, n_heads, head_dim), cache)
        k = rope((x @ k_rows.T).view(1, seqlen, n_heads, head_dim), cache)
        return torch.einsum("bqhd,bkhd->bhqk", q, k)

    ours = scores(wq, wk, lambda x, cache: apply_rotary_emb(x, cache, torch.arange(seqlen)))
    theirs = scores(pairs_to_halves(wq, n_heads), pairs_to_halves(wk, n_heads), rotate_half_rope)
    assert torch.allclose(ours, theirs, atol=1e-4)
    assert not torch.allclose(ours, scores(wq, wk, rotate_half_rope), atol=1e-2)  # the permutation matters
    assert torch.equal(halves_to_pairs(pairs_to_halves(wq, n_heads), n_heads), wq)


def test_names_cover_every_parameter_and_tied_head_reads_the_embedding():
    adapter = Llama3HFAdapter(TINY_ARGS)
    model = Transformer(TINY_ARGS)
    names = {adapter.hf_name(fqn) for fqn in model.state_dict()}
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    assert len(names) == len(model.state_dict())
    tied = Llama3HFAdapter(replace(TINY_ARGS, tie_word_embeddings=True))
    assert tied.hf_name("output.weight") == "model.embed_tokens.weight"
    assert tied.to_hf("output.weight", torch.zeros(1)) is None
    with pytest.raises(ValueError, match="no Hugging Face name"):
        adapter.hf_name("layers.0.attention.rotary.weight")


@pytest.mark.parametrize("tie", [False, True])
def test_export_then_import_is_bit_exact(tmp_path, tie):
    args = replace(TINY_ARGS, tie_word_embeddings=tie)
    torch.manual_seed(1)
    source, target = Transformer(args), Transformer(args)
    adapter = Llama3HFAdapter(args)
    files = save_hf(model_state_dict([source]), tmp_path, adapter, torch.float32, max_shard_bytes=60_000)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(files) > 3  # sharded, with an index
    assert ("lm_head.weight" in safetensors_index(tmp_path)) is not tie
    load_hf_weights([target], tmp_path, adapter)
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items()):
        assert torch.equal(a, b), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert llama3_args_from_hf_config(config).ffn_hidden_dim == args.ffn_hidden_dim


def test_import_refuses_a_different_model_and_missing_tensors(tmp_path):
    save_hf(model_state_dict([Transformer(TINY_ARGS)]), tmp_path, Llama3HFAdapter(TINY_ARGS), torch.float32)
    wider = replace(TINY_ARGS, n_heads=8, n_kv_heads=4)
    with pytest.raises(DtrainError, match="n_heads = 4, this model has 8"):
        load_hf_weights([Transformer(wider)], tmp_path, Llama3HFAdapter(wider))
    (tmp_path / "config.json").unlink()
    deeper = replace(TINY_ARGS, n_layers=3)
    with pytest.raises(DtrainError, match=r"lacks model\.layers\.2\..* \(for layers\.2\..*\) and 8 more"):
        load_hf_weights([Transformer(deeper)], tmp_path, Llama3HFAdapter(deeper))


def test_bfloat16_export_writes_bfloat16(tmp_path):
    from safetensors import safe_open

    save_hf(model_state_dict([Transformer(TINY_ARGS)]), tmp_path, Llama3HFAdapter(TINY_ARGS), torch.bfloat16)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("tie", [False, True])
def test_exported_model_matches_transformers_llama_logits(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    args = replace(TINY_ARGS, tie_word_embeddings=tie)
    torch.manual_seed(2)
    ours = Transformer(args).eval()
    save_hf(model_state_dict([ours]), tmp_path, Llama3HFAdapter(args), torch.float32)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    with torch.no_grad():
        expected = ours(tokens)
        got = theirs(input_ids=tokens).logits
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()

    # ... and a LlamaForCausalLM built by transformers itself imports into ours with the same logits.
    config = transformers.LlamaConfig(**{k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items()
                                        if k not in ("architectures", "torch_dtype")})
    native = transformers.LlamaForCausalLM(config).eval()
    native.save_pretrained(str(tmp_path / "native"))
    imported = Transformer(args).eval()
    load_hf_weights([imported], tmp_path / "native", Llama3HFAdapter(args))
    with torch.no_grad():
        assert torch.allclose(imported(tokens), native(input_ids=tokens).logits, atol=1e-4)
