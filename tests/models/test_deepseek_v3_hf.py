"""The DeepSeek-V3 family and Hugging Face: names, the stacked experts, config.json both ways with what it refuses,
and logits and greedy generation against transformers' DeepseekV3ForCausalLM on small random models."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_deepseek_v3 import TINY

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import load_hf_weights, save_hf
from dtrain.config import load_config, to_toml
from dtrain.models.decoding import generate
from dtrain.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, DeepSeekV3HFAdapter, DeepSeekV3Transformer

# test_deepseek_v3.py's shape: v_head_dim differs from the qk head size, YaRN with both of its factors != 1 and an
# original length shorter than the sequences, DeepSeek-V3's routing (sigmoid, bias, 4 groups of which 2).
VARIANTS = {
    "full_query": TINY,
    "low_rank_query": replace(TINY, q_lora_rank=24),
    "tied_plain_rope": replace(TINY, tie_word_embeddings=True, rope_scaling=None),
    # torchtitan's YaRN rule, on at max_seq_len 64 > 16; a block/final norm eps large enough to show in the logits
    # should HF give it to the latent norms too (their eps stays 1e-6, Hugging Face's).
    "torchtitan_rule_yarn_on": replace(TINY, q_lora_rank=24, norm_eps=1e-2, rope_scaling_beyond_original_only=True),
    # ... and off: the original context (64) covers max_seq_len, so the model computes plain RoPE.
    "torchtitan_rule_yarn_off": replace(
        TINY, rope_scaling=replace(TINY.rope_scaling, original_max_position_embeddings=64),
        rope_scaling_beyond_original_only=True,
    ),
}
# A torchtitan 0.2.2 flavor's numerics (models/deepseek_v3/args.py) on TINY's shape: what HF's class cannot compute.
TORCHTITAN_TINY = replace(TINY, norm_eps=1e-5, latent_norm_eps=1e-5, final_norm_dtype_eps=True,
                          rope_scaling_beyond_original_only=True)


def _ours(args: DeepSeekV3Args, seed: int = 3) -> DeepSeekV3Transformer:
    """A random model whose norms and routing biases are not at their init values (ones, zeros), so that a
    misplaced one shows in the logits."""
    torch.manual_seed(seed)
    model = DeepSeekV3Transformer(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for block in model.layers.values():
            if block.moe is not None:
                block.moe.expert_bias.uniform_(-0.05, 0.05)
    return model


def _save_hf(model: DeepSeekV3Transformer, folder) -> None:
    save_hf(model_state_dict([model]), folder, DeepSeekV3HFAdapter(model.args), torch.float32)


def _load_hf(args: DeepSeekV3Args, folder) -> DeepSeekV3Transformer:
    model = DeepSeekV3Transformer(args).eval()
    load_hf_weights([model], folder, DeepSeekV3HFAdapter(args))
    return model


def test_names_and_stacked_experts():
    adapter = DeepSeekV3HFAdapter(VARIANTS["low_rank_query"])
    assert adapter.hf_names("layers.0.attention.wq_a.weight") == ["model.layers.0.self_attn.q_a_proj.weight"]
    assert adapter.hf_names("layers.2.attention.kv_norm.weight") == ["model.layers.2.self_attn.kv_a_layernorm.weight"]
    assert adapter.hf_names("layers.1.moe.expert_bias") == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert adapter.hf_names("layers.1.moe.experts.w2") == [
        f"model.layers.1.mlp.experts.{j}.down_proj.weight" for j in range(8)
    ]
    w1 = torch.randn(8, 24, 64)
    pairs = adapter.to_hf_tensors("layers.1.moe.experts.w1", w1)
    assert [name for name, _ in pairs][3] == "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert torch.equal(adapter.from_hf("layers.1.moe.experts.w1", *(t for _, t in pairs)), w1)
    with pytest.raises(ValueError, match="no Hugging Face name for deepseek_v3 parameter 'layers.1.moe.w9'"):
        adapter.hf_names("layers.1.moe.w9")


def test_a_model_without_a_routing_bias_exports_hfs_zero_bias():
    args = replace(TINY, moe_load_balance_bias=False)
    pairs = DeepSeekV3HFAdapter(args).to_hf_tensors("layers.2.moe.router.gate.weight", torch.randn(8, 64))
    names = [name for name, _ in pairs]
    assert names == ["model.layers.2.mlp.gate.weight", "model.layers.2.mlp.gate.e_score_correction_bias"]
    assert torch.equal(pairs[1][1], torch.zeros(8))


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_round_trip(variant):
    args = VARIANTS[variant]
    adapter = DeepSeekV3HFAdapter(args)
    config = adapter.hf_config(torch.bfloat16)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    # The export is the model as it computes: YaRN only where it is on, and then at every length (HF's rule).
    assert (config["rope_scaling"] is None) == (args.active_rope_scaling is None)
    as_computed = replace(args, rope_scaling=args.active_rope_scaling, rope_scaling_beyond_original_only=False)
    assert DeepSeekV3HFAdapter.args_from_hf_config(config) == as_computed
    adapter.check_hf_config(config)
    with pytest.raises(ValueError, match="moe_top_k = 2"):
        adapter.check_hf_config({**config, "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match="v_head_dim"):
        adapter.check_hf_config({**config, "v_head_dim": 8})


def test_the_published_v3_config_maps_to_the_671b_flavor():
    # The keys of deepseek-ai/DeepSeek-V3's config.json that decide the model (its FP8 quantization left out).
    published = {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 3,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
        "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1, "hidden_act": "silu",
    }
    # The flavor is torchtitan 0.2.2's, whose norms take eps 1e-5 (the published 1e-6 otherwise) and whose YaRN
    # starts past 4096 tokens (models/deepseek_v3/args.py); its shape and routing are the published ones.
    flavor = DEEPSEEK_V3_FLAVORS["671B"]
    with pytest.raises(ValueError, match="has norm_eps = 1e-06, this model has 1e-05"):
        DeepSeekV3HFAdapter(flavor).check_hf_config(published)
    hf_numerics = replace(flavor, norm_eps=1e-6, latent_norm_eps=1e-6, final_norm_dtype_eps=False)
    with pytest.raises(ValueError, match="has active_rope_scaling = YarnScaling.*, this model has None"):
        DeepSeekV3HFAdapter(hf_numerics).check_hf_config(published)  # at 4096 tokens torchtitan's YaRN is off
    DeepSeekV3HFAdapter(replace(hf_numerics, max_seq_len=8192)).check_hf_config(published)
    with pytest.raises(ValueError, match="quantized \\(fp8\\); dequantize"):
        DeepSeekV3HFAdapter.args_from_hf_config({**published, "quantization_config": {"quant_method": "fp8"}})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_interleave": False}, "rope_interleave false"),
        ({"scoring_func": "softmax"}, "routes by sigmoid"),
        ({"model_type": "deepseek_v2"}, "not deepseek_v3"),
        ({"num_key_value_heads": 2}, "num_key_value_heads 2"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
    ],
)
def test_unrepresentable_configs_are_refused_in_one_line(change, message):
    config = {**DeepSeekV3HFAdapter(TINY).hf_config(torch.float32), **change}
    with pytest.raises(ValueError, match=message):
        DeepSeekV3HFAdapter.args_from_hf_config(config)


def test_softmax_routing_has_no_deepseek_v3_export():
    adapter = DeepSeekV3HFAdapter(DEEPSEEK_V3_FLAVORS["16B"])
    with pytest.raises(ValueError, match="model.args.moe_score_func = 'softmax'"):
        adapter.hf_config(torch.bfloat16)
    with pytest.raises(ValueError, match="moe_score_func"):
        adapter.to_hf_tensors("norm.weight", torch.ones(2048))


@pytest.mark.parametrize(
    "args, message",
    [
        (TORCHTITAN_TINY, "latent_norm_eps = 1e-05 has no DeepseekV3ForCausalLM form .*valid: 1e-06"),
        (replace(TORCHTITAN_TINY, latent_norm_eps=1e-6), "final_norm_dtype_eps = true has no .*valid: false"),
    ],
)
def test_torchtitan_numerics_have_no_hf_export(tmp_path, args, message):
    with pytest.raises(ValueError, match=f"^model.args.{message}") as refused:
        DeepSeekV3HFAdapter(args).hf_config(torch.float32)
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=message):
        _save_hf(_ours(args), tmp_path)
    assert list(tmp_path.iterdir()) == []  # no weight, no config.json
    # The flavor whose routing HF has: torchtitan's eps refused too.
    with pytest.raises(ValueError, match="latent_norm_eps = 1e-05"):
        DeepSeekV3HFAdapter(DEEPSEEK_V3_FLAVORS["671B"]).hf_config(torch.bfloat16)
    # At Hugging Face's values (norm_eps is expressible, YaRN on past 16 tokens) it exports.
    hf_values = replace(args, latent_norm_eps=1e-6, final_norm_dtype_eps=False)
    assert DeepSeekV3HFAdapter(hf_values).hf_config(torch.float32)["rms_norm_eps"] == 1e-5


def test_convert_checkpoint_refuses_torchtitan_numerics_before_reading_or_writing(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", Path(__file__).resolve().parents[2] / "scripts" / "convert_checkpoint.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    # debugmodel_small (sigmoid routing) with torchtitan's latent eps, as a run's config.toml records it.
    cfg = load_config(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_small",
                       "--model.args.latent_norm_eps", "1e-5"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    out = tmp_path / "hf"
    # No checkpoint at all: the refusal comes before any weight is read.
    argv = ["to-hf", str(tmp_path / "absent"), str(out), "--config", str(tmp_path / "config.toml")]
    assert convert.main(argv) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: cannot export")
    assert "model.args.latent_norm_eps = 1e-05 has no DeepseekV3ForCausalLM form" in error
    assert not out.exists()


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers_deepseek_v3_both_ways(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    args = VARIANTS[variant]
    ours = _ours(args)
    _save_hf(ours, tmp_path)
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    # Longer than TINY's original 16 positions.
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(input_ids=tokens).logits, atol=1e-5, rtol=0)

    # ... and a DeepseekV3ForCausalLM built by transformers itself imports into ours with the same logits.
    config = json.loads((tmp_path / "config.json").read_text())
    native = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})
    ).eval()
    with torch.no_grad():
        for name, buffer in native.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    native.save_pretrained(str(tmp_path / "native"))
    imported = _load_hf(args, tmp_path / "native")
    with torch.no_grad():
        torch.testing.assert_close(imported(tokens), native(input_ids=tokens).logits, atol=1e-5, rtol=0)


def test_greedy_generation_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = _ours(TINY)
    with torch.no_grad():  # larger weights than the init's, so that greedy choices vary from token to token
        for p in ours.parameters():
            p.mul_(4.0 if p.ndim > 1 else 1.0)
    _save_hf(ours, tmp_path)
    theirs = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    prompt = torch.randint(0, TINY.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    new = generate(ours, prompt, 16)
    with torch.no_grad():
        expected = theirs.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, min_new_tokens=16, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    assert torch.equal(new, expected[:, 6:])
    assert len(set(new[0].tolist())) > 2
