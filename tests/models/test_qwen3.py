"""The Qwen3 family: flavors, QK-norm and head_dim, the family spec, and Hugging Face interop (logits against
transformers' Qwen3ForCausalLM on small random models)."""

from __future__ import annotations

import json

import pytest
import torch

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import load_hf_weights, save_hf
from dtrain.models import count_params
from dtrain.models.qwen3 import QWEN3, QWEN3_FLAVORS, Qwen3Args, Qwen3HFAdapter, Qwen3Transformer
from dtrain.parallelize import get_family

# head_dim 24 with dim 64 and 4 heads: the head size is independent of dim / n_heads.
TINY = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=96, vocab_size=128,
                 max_seq_len=32)


@pytest.mark.parametrize(
    "flavor, billions",
    # The published sizes (embedding included; tied on the small ones).
    [("0.6B", 0.596), ("1.7B", 1.721), ("4B", 4.022), ("8B", 8.191), ("14B", 14.768), ("32B", 32.762)],
)
def test_flavor_sizes_match_the_published_models(flavor, billions):
    with torch.device("meta"):
        model = Qwen3Transformer(QWEN3_FLAVORS[flavor])
    assert count_params(model) / 1e9 == pytest.approx(billions, abs=5e-4)


def test_qk_norm_and_independent_head_dim():
    model = Qwen3Transformer(TINY)
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (4 * 24, 64) and attention.wk.weight.shape == (2 * 24, 64)
    assert attention.q_norm.weight.shape == (24,) and attention.k_norm.weight.shape == (24,)
    names = set(model.state_dict())
    assert "layers.1.attention.q_norm.weight" in names and "layers.1.attention.k_norm.weight" in names
    logits = model(torch.randint(0, 128, (2, 10)))
    assert logits.shape == (2, 10, 128) and torch.isfinite(logits).all()


def test_registered_as_one_spec():
    spec = get_family("qwen3")
    assert spec.model is QWEN3 and spec.name == "qwen3"
    # torchtitan 0.2.2's flavors and dtrain's small MoE.
    assert set(QWEN3.flavors) == {"debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "debugmodel_moe",
                                  "debugmodel_moe_small", "30B-A3B", "235B-A22B"}
    assert QWEN3.flavors["0.6B"].tie_word_embeddings and not QWEN3.flavors["8B"].tie_word_embeddings
    assert "layers.*.attention.q_norm" in spec.tp_plan()
    # FLOPs count attention over n_heads * head_dim, not dim.
    assert QWEN3.flops_per_token(TINY, 32) - QWEN3.flops_per_token(TINY, 16) == 6 * 2 * 4 * 24 * 16


def test_hf_names_and_config_round_trip():
    adapter = Qwen3HFAdapter(TINY)
    assert adapter.hf_name("layers.0.attention.q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    config = adapter.hf_config(torch.float32)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 24
    assert Qwen3HFAdapter.args_from_hf_config(config) == TINY
    adapter.check_hf_config(config)
    with pytest.raises(ValueError, match="head_dim"):
        adapter.check_hf_config({**config, "head_dim": 16})


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers_qwen3_both_ways(tmp_path, tie):
    transformers = pytest.importorskip("transformers")
    args = Qwen3Args(**{**TINY.__dict__, "tie_word_embeddings": tie})
    torch.manual_seed(3)
    ours = Qwen3Transformer(args).eval()
    with torch.no_grad():  # QK-norm weights start at ones: make them matter for the layout check
        for block in ours.layers.values():
            block.attention.q_norm.weight.uniform_(0.5, 1.5)
            block.attention.k_norm.weight.uniform_(0.5, 1.5)
    save_hf(model_state_dict([ours]), tmp_path, Qwen3HFAdapter(args), torch.float32)
    theirs = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    tokens = torch.randint(0, args.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=tokens).logits, ours(tokens), atol=1e-4)

    # ... and a Qwen3ForCausalLM built by transformers itself imports into ours with the same logits.
    saved = json.loads((tmp_path / "config.json").read_text())
    config = transformers.Qwen3Config(**{k: v for k, v in saved.items() if k not in ("architectures", "torch_dtype")})
    native = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in native.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    native.save_pretrained(str(tmp_path / "native"))
    imported = Qwen3Transformer(args).eval()
    load_hf_weights([imported], tmp_path / "native", Qwen3HFAdapter(args))
    with torch.no_grad():
        assert torch.allclose(imported(tokens), native(input_ids=tokens).logits, atol=1e-4)
