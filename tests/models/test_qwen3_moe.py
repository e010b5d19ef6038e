"""Qwen3-MoE, the qwen3 family's flavors with routed experts: shapes and published sizes, active-parameter FLOPs,
`[model.args]` overrides and the config.toml round trip, training, and Hugging Face interop (logits and greedy
generation against transformers' Qwen3MoeForCausalLM on small random models, both ways)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from dtrain.checkpoint.dcp_io import model_state_dict
from dtrain.checkpoint.hf_io import load_hf_weights, safetensors_index, save_hf
from dtrain.config import load_config, to_toml
from dtrain.errors import ConfigError
from dtrain.models import count_params
from dtrain.models.decoding import generate
from dtrain.models.flops import matmul_params
from dtrain.models.moe import MoE
from dtrain.models.qwen3 import QWEN3, QWEN3_FLAVORS, Qwen3Args, Qwen3HFAdapter, Qwen3Transformer
from dtrain.run.prepare import prepare

# 8 experts of width 32, 2 per token, with head_dim independent of dim; hidden_dim is HF's unused
# intermediate_size.
TINY_MOE = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=96, vocab_size=128,
                     max_seq_len=64, moe_num_experts=8, moe_top_k=2, moe_hidden_dim=32, moe_route_norm=True)


def inactive_expert_params(args: Qwen3Args) -> int:
    """The routed experts' parameters a token does not pass through, over all blocks."""
    return args.n_layers * (args.moe_num_experts - args.moe_top_k) * 3 * args.dim * args.moe_hidden_dim


@pytest.mark.parametrize(
    "flavor, total, non_embedding, active, last_digit",
    # Qwen's model cards: 30.5B parameters (29.9B without the embedding and the head) of which 3.3B activated;
    # 235B (234B) of which 22B. Totals match to half their last printed digit; the activated counts to one (the
    # 30B card prints 3.35B as 3.3B).
    [("30B-A3B", 30.5, 29.9, 3.3, 0.1), ("235B-A22B", 235, 234, 22, 1)],
)
def test_flavor_sizes_match_the_published_models(flavor, total, non_embedding, active, last_digit):
    args = QWEN3_FLAVORS[flavor]
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    params, embedding_and_head = count_params(model), 2 * args.vocab_size * args.dim
    assert params / 1e9 == pytest.approx(total, abs=last_digit / 2)
    assert (params - embedding_and_head) / 1e9 == pytest.approx(non_embedding, abs=last_digit / 2)
    assert (params - inactive_expert_params(args)) / 1e9 == pytest.approx(active, abs=last_digit)


def test_flavors_have_the_published_shapes():
    a3b, a22b, debug = QWEN3_FLAVORS["30B-A3B"], QWEN3_FLAVORS["235B-A22B"], QWEN3_FLAVORS["debugmodel_moe"]
    assert (a3b.dim, a3b.n_layers, a3b.n_heads, a3b.n_kv_heads, a3b.head_dim) == (2048, 48, 32, 4, 128)
    assert (a22b.dim, a22b.n_layers, a22b.n_heads, a22b.n_kv_heads, a22b.head_dim) == (4096, 94, 64, 4, 128)
    # torchtitan 0.2.2's settings (tests/reference/test_torchtitan_flavors.py): no load balancing, and the
    # 235B's RoPE theta of the 2507 release.
    for args in (a3b, a22b, debug):
        assert (args.moe_top_k, args.moe_route_norm, args.moe_aux_loss_coeff, args.moe_load_balance_bias) == (
            8, True, 0.0, False)
        assert not args.tie_word_embeddings
    for args in (a3b, a22b):
        assert args.moe_num_experts == 128 and args.vocab_size == 151936
    assert (a3b.rope_theta, a22b.rope_theta) == (1e6, 5e6)
    assert (a3b.moe_hidden_dim, a22b.moe_hidden_dim) == (768, 1536)
    assert (debug.vocab_size, debug.moe_num_experts, debug.moe_hidden_dim) == (2048, 64, 768)
    small = QWEN3_FLAVORS["debugmodel_moe_small"]  # dtrain's, for a CPU
    assert small.vocab_size == 2048 and small.tie_word_embeddings and small.moe_num_experts == 16
    assert small.moe_aux_loss_coeff == 0.001
    moe = a3b.moe
    assert (moe.num_experts, moe.top_k, moe.hidden_dim, moe.num_shared_experts, moe.score_func) == (
        128, 8, 768, 0, "softmax")
    assert all(QWEN3_FLAVORS[name].moe is None for name in ("debugmodel", "0.6B", "8B", "32B"))


def test_every_block_routes_to_experts_under_torchtitans_names():
    model = Qwen3Transformer(TINY_MOE)
    for block in model.layers.values():
        assert isinstance(block.moe, MoE) and block.feed_forward is None
    names = set(model.state_dict())
    assert {"layers.1.moe.router.gate.weight", "layers.1.moe.experts.w1", "layers.1.moe.experts.w2",
            "layers.1.moe.experts.w3"} <= names
    assert not any("feed_forward" in name or "shared_experts" in name for name in names)
    experts = model.layers["1"].moe.experts
    assert experts.w1.shape == (8, 32, 64) and experts.w2.shape == (8, 64, 32) and experts.w3.shape == (8, 32, 64)
    logits = model(torch.randint(0, 128, (2, 10)))
    assert logits.shape == (2, 10, 128) and torch.isfinite(logits).all()
    dense = Qwen3Transformer(replace(TINY_MOE, moe_num_experts=0))
    assert dense.layers["0"].moe is None and not any(".moe." in name for name in dense.state_dict())


def test_experts_init_like_the_dense_feed_forward():
    torch.manual_seed(0)
    model = Qwen3Transformer(replace(TINY_MOE, n_layers=4, moe_hidden_dim=256))
    deep = model.layers["3"].moe
    assert deep.experts.w1.std().item() == pytest.approx(0.02, rel=0.1)
    # depth-scaled, as the dense w2/w3 of block 3; the gate too, as torchtitan's
    for weight in (deep.experts.w2, deep.experts.w3, deep.router.gate.weight):
        assert weight.std().item() == pytest.approx(0.02 / 8**0.5, rel=0.1)


def test_flops_count_only_the_active_experts():
    args = TINY_MOE
    attention = 2 * 64 * 4 * 24 + 2 * 64 * 2 * 24
    active_moe = 64 * 8 + 2 * 3 * 64 * 32  # the gate, then top_k = 2 of the 8 experts
    assert matmul_params(args) == 2 * (attention + active_moe) + 64 * 128
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    norms = 2 * (2 * 64 + 2 * 24) + 64
    # Untied: every parameter but the embedding and the norms is a matmul weight; of the experts, the active ones.
    assert matmul_params(args) == count_params(model, exclude_embedding=True) - norms - inactive_expert_params(args)
    attention_term = 6 * 2 * 4 * 24 * 32
    assert QWEN3.flops_per_token(args, 32) == 6 * matmul_params(args) + attention_term
    # The dense formula is unchanged: an FFN of width hidden_dim.
    dense = replace(args, moe_num_experts=0)
    assert matmul_params(dense) == 2 * (attention + 3 * 64 * 96) + 64 * 128


def test_moe_settings_are_filled_and_checked():
    filled = Qwen3Args(moe_num_experts=64)
    assert (filled.moe_top_k, filled.moe_hidden_dim, filled.moe_route_norm, filled.moe_aux_loss_coeff,
            filled.moe_load_balance_bias) == (8, 768, True, 0.001, False)
    assert Qwen3Args().moe is None and Qwen3Args().moe_top_k is None
    with pytest.raises(ValueError, match=r"Qwen3Args.moe_top_k must be in \[1, moe_num_experts=4\], got 8"):
        Qwen3Args(moe_num_experts=4)
    with pytest.raises(ValueError, match="Qwen3Args.moe_num_experts must be >= 0"):
        Qwen3Args(moe_num_experts=-1)
    with pytest.raises(ValueError, match="Qwen3Args.moe_hidden_dim must be > 0"):
        Qwen3Args(moe_num_experts=8, moe_top_k=2, moe_hidden_dim=0)


def test_model_args_overrides_reach_the_moe_and_config_toml_rebuilds_it(tmp_path):
    (tmp_path / "debug_model.toml").write_text("")  # the default config the loader starts from

    def load(argv):
        return load_config(["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small", "--model.args.n_layers",
                            "2", *argv], env={}, configs_dir=tmp_path)

    cfg = load(["--model.args.moe_top_k", "2", "--model.args.moe_load_balance_bias", "true"])
    args = prepare(cfg).model_args
    assert (args.moe_num_experts, args.moe_top_k, args.moe_load_balance_bias, args.moe_hidden_dim) == (
        16, 2, True, 128)
    assert cfg.model.args["moe_top_k"] == 2 and cfg.model.args["moe_num_experts"] == 16
    written = tmp_path / "config.toml"
    written.write_text(to_toml(cfg))
    assert "moe_top_k = 2\n" in written.read_text()
    assert prepare(load_config(["--config", str(written)], env={}, configs_dir=tmp_path)).model_args == args

    # Dense from an MoE flavor, and MoE from a dense one, rebuild the same way.
    for argv in (["--model.args.moe_num_experts", "0"],
                 ["--model.flavor", "debugmodel", "--model.args.moe_num_experts", "8", "--model.args.moe_top_k",
                  "2"]):
        cfg = load(argv)
        args = prepare(cfg).model_args
        written.write_text(to_toml(cfg))
        assert prepare(load_config(["--config", str(written)], env={}, configs_dir=tmp_path)).model_args == args
    assert args.moe_num_experts == 8 and args.moe_hidden_dim == 768

    with pytest.raises(ConfigError, match=r"model.args: Qwen3Args.moe_top_k must be in \[1, moe_num_experts=16\]"):
        prepare(load(["--model.args.moe_top_k", "17"]))
    with pytest.raises(ConfigError, match="did you mean model.args.moe_top_k"):
        prepare(load(["--model.args.moe_topk", "2"]))


def test_trains_single_process_with_a_load_balancing_loss():
    torch.manual_seed(0)
    args = replace(QWEN3_FLAVORS["debugmodel_moe_small"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                   vocab_size=256, max_seq_len=32)
    model = Qwen3Transformer(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, args.vocab_size, (4, 33))
    losses = []
    for _ in range(8):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        aux = sum(block.moe.aux_loss for block in model.layers.values())
        optimizer.zero_grad()
        (loss + aux).backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    gate = model.layers["0"].moe.router.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    assert model.layers["0"].moe.tokens_per_expert.sum() == 8 * 4 * 32 * args.moe_top_k


# --- Hugging Face -------------------------------------------------------------------------------------------------

def test_hf_names_and_config_round_trip():
    adapter = Qwen3HFAdapter(TINY_MOE)
    assert adapter.hf_names("layers.1.moe.router.gate.weight") == ["model.layers.1.mlp.gate.weight"]
    names = adapter.hf_names("layers.1.moe.experts.w2")
    assert names[0] == "model.layers.1.mlp.experts.0.down_proj.weight" and len(names) == 8
    assert adapter.hf_names("layers.0.moe.experts.w1")[7] == "model.layers.0.mlp.experts.7.gate_proj.weight"
    assert adapter.hf_names("layers.0.moe.experts.w3")[3] == "model.layers.0.mlp.experts.3.up_proj.weight"
    config = adapter.hf_config(torch.float32)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (8, 2, 32)
    assert config["norm_topk_prob"] and config["mlp_only_layers"] == [] and config["decoder_sparse_step"] == 1
    assert Qwen3HFAdapter.args_from_hf_config(config) == TINY_MOE
    adapter.check_hf_config(config)
    with pytest.raises(ValueError, match="moe_top_k = 4, this model has 2"):
        adapter.check_hf_config({**config, "num_experts_per_tok": 4})


@pytest.mark.parametrize("field, value, message", [
    ("mlp_only_layers", [0], r"mlp_only_layers = \[0\] is not supported .* valid is \[\]"),
    ("decoder_sparse_step", 2, "decoder_sparse_step = 2 is not supported .* valid is 1"),
    ("use_sliding_window", True, "use_sliding_window = true is not supported"),
    ("model_type", "mixtral", "model_type 'mixtral' is not qwen3 or qwen3_moe"),
])
def test_hf_configs_this_model_cannot_represent_are_refused(field, value, message):
    config = Qwen3HFAdapter(TINY_MOE).hf_config(torch.float32)
    with pytest.raises(ValueError, match=message):
        Qwen3HFAdapter.args_from_hf_config({**config, field: value})


def test_hf_config_without_experts_is_the_dense_model():
    config = {**Qwen3HFAdapter(TINY_MOE).hf_config(torch.float32), "num_experts": 0}
    assert Qwen3HFAdapter.args_from_hf_config(config) == replace(TINY_MOE, moe_num_experts=0, moe_top_k=None,
                                                                 moe_hidden_dim=None, moe_route_norm=None,
                                                                 moe_aux_loss_coeff=None, moe_load_balance_bias=None)


def test_a_load_balancing_bias_is_not_exported(tmp_path):
    args = replace(TINY_MOE, moe_load_balance_bias=True)
    with pytest.raises(ValueError, match="expert_bias .* has no Hugging Face counterpart"):
        save_hf(model_state_dict([Qwen3Transformer(args)]), tmp_path, Qwen3HFAdapter(args), torch.float32)


def widen_routing_and_qk_norms(model: torch.nn.Module) -> None:
    """Random QK-norm weights (they start at ones) and a wide router, so that the layouts matter and the top-k
    choices are clear-cut rather than near ties that rounding could flip."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("moe.router.gate.weight", "mlp.gate.weight")):
                p.normal_(0.0, 1.0)


@pytest.mark.parametrize("tie, route_norm", [(False, True), (True, False)])
def test_logits_match_transformers_qwen3_moe_both_ways(tmp_path, tie, route_norm):
    transformers = pytest.importorskip("transformers")
    args = replace(TINY_MOE, tie_word_embeddings=tie, moe_route_norm=route_norm)
    torch.manual_seed(3)
    ours = Qwen3Transformer(args).eval()
    widen_routing_and_qk_norms(ours)
    files = save_hf(model_state_dict([ours]), tmp_path, Qwen3HFAdapter(args), torch.float32, max_shard_bytes=200_000)
    assert len(files) > 2 and "model.layers.1.mlp.experts.7.down_proj.weight" in safetensors_index(tmp_path)
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    tokens = torch.randint(0, args.vocab_size, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens).logits, ours(tokens), atol=1e-4, rtol=0)

    # ... and a Qwen3MoeForCausalLM built and saved by transformers itself imports into ours with the same logits.
    saved = json.loads((tmp_path / "config.json").read_text())
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in saved.items() if k not in ("architectures",
                                                                                      "torch_dtype")})
    native = transformers.Qwen3MoeForCausalLM(config).eval()
    widen_routing_and_qk_norms(native)
    native.save_pretrained(str(tmp_path / "native"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in safetensors_index(tmp_path / "native")
    imported = Qwen3Transformer(args).eval()
    load_hf_weights([imported], tmp_path / "native", Qwen3HFAdapter(args))
    with torch.no_grad():
        torch.testing.assert_close(imported(tokens), native(input_ids=tokens).logits, atol=1e-4, rtol=0)


def test_greedy_generation_equals_transformers(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from dtrain.generate import main as generate_main

    torch.manual_seed(14)
    # Wide initial weights: a random model at the usual 0.02 repeats one token, which tests little.
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, vocab_size=128, max_position_embeddings=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, bos_token_id=1, eos_token_id=2, initializer_range=0.5,
    )
    theirs = transformers.Qwen3MoeForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    prompt = [5, 17, 33, 9, 64]
    expected = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24)[0, len(prompt):].tolist()
    assert len(set(expected)) > 3  # the model says something, not one token over and over

    # Through run_generate's path: the family and shape come from config.json's Qwen3MoeForCausalLM.
    code = generate_main(["--checkpoint", str(tmp_path), "--hf", "--prompt_ids", ",".join(map(str, prompt)),
                          "--max_new_tokens", "24", "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0, out.err
    ids = next(line for line in out.out.splitlines() if line.startswith("ids: ")).removeprefix("ids: ")
    assert [int(i) for i in ids.split(",")] == expected

    # And the model directly, with the KV cache.
    args = Qwen3HFAdapter.args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    ours = Qwen3Transformer(args).eval()
    load_hf_weights([ours], tmp_path, Qwen3HFAdapter(args))
    assert generate(ours, torch.tensor([prompt]), 24, eos_ids=(2,))[0].tolist() == expected
