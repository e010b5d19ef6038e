"""The DeepSeek-V3 family on one device: flavors and their sizes, args checks, MLA and its YaRN scaling, the
decoder protocol (meta init, pipeline stages, document masking), FLOPs by active parameters, generation and a few
training steps."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from dtrain.models import count_params
from dtrain.models.decoding import generate
from dtrain.models.deepseek_v3 import (
    DEEPSEEK_V3,
    DEEPSEEK_V3_FLAVORS,
    DeepSeekV3Args,
    DeepSeekV3Transformer,
    YarnScaling,
    active_params,
    num_flops_per_token,
)
from dtrain.models.deepseek_v3.yarn import precompute_yarn_rope_cache, softmax_scale_factor, table_scale

# v_head_dim (12) differs from the query/key head size (16 + 8), YaRN is on with different mscales (so both of its
# factors differ from 1) and an original length shorter than the tests' sequences, and the MoE routes like
# DeepSeek-V3's: sigmoid, a selection bias, 4 groups of which 2 per token, renormalised and scaled.
TINY = DeepSeekV3Args(
    dim=64, n_layers=3, n_dense_layers=1, hidden_dim=96, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, vocab_size=128, max_seq_len=64,
    rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale=0.8, mscale_all_dim=0.6),
    moe_num_experts=8, moe_top_k=3, moe_hidden_dim=24, moe_num_shared_experts=1, moe_score_func="sigmoid",
    moe_route_norm=True, moe_route_scale=2.5, moe_num_expert_groups=4, moe_num_limited_groups=2,
    moe_load_balance_bias=True,
)
TINY_LOW_RANK_Q = replace(TINY, q_lora_rank=24)


def _tokens(batch=2, seqlen=24, seed=123):
    return torch.randint(0, TINY.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "flavor, total, active",
    # Published: DeepSeek-V2-Lite 15.7B with 2.4B activated, DeepSeek-V2 236B with 21B, DeepSeek-V3 671B with 37B.
    [("16B", 15.706, 2.45), ("236B", 235.741, 20.85), ("671B", 671.03, 36.63)],
)
def test_flavor_sizes_match_the_published_models(flavor, total, active):
    args = DEEPSEEK_V3_FLAVORS[flavor]
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    assert count_params(model) / 1e9 == pytest.approx(total, abs=5e-3)
    assert active_params(args) / 1e9 == pytest.approx(active, abs=1e-2)


def test_flavors_are_torchtitans_names_and_shapes():
    # torchtitan 0.2.2's (tests/reference/test_torchtitan_flavors.py compares every field) and dtrain's small one.
    assert set(DEEPSEEK_V3.flavors) == {"debugmodel", "debugmodel_flex_attn", "debugmodel_small", "16B", "236B", "671B"}
    v2_lite, v3 = DEEPSEEK_V3_FLAVORS["16B"], DEEPSEEK_V3_FLAVORS["671B"]
    assert (v2_lite.q_lora_rank, v2_lite.moe.score_func, v2_lite.moe.num_shared_experts) == (0, "softmax", 2)
    assert (v3.q_lora_rank, v3.moe.num_expert_groups, v3.moe.num_limited_groups) == (1536, 8, 4)
    assert v3.moe.load_balance_bias and v3.moe.route_norm and v3.moe.score_func == "sigmoid"
    assert v3.n_dense_layers == 3 and v3.moe.route_scale == 2.5 and v3.moe.bias_update_speed == 1e-3
    for flavor, size in (("debugmodel", 34e6), ("debugmodel_small", 14e6)):
        with torch.device("meta"):
            model = DeepSeekV3Transformer(DEEPSEEK_V3_FLAVORS[flavor])
        assert count_params(model) < size
        assert model.layers["0"].feed_forward is not None and model.layers["0"].moe is None
        assert all(model.layers[str(i)].moe is not None for i in range(1, 6))


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"n_dense_layers": 4}, "n_dense_layers"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"v_head_dim": 25}, "v_head_dim"),
        ({"q_lora_rank": -1}, "q_lora_rank"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"moe_top_k": 9}, "moe_top_k"),
        ({"moe_top_k": 5}, "moe_top_k"),  # more than the 4 experts of 2 limited groups
        ({"moe_score_func": "relu"}, "moe_score_func"),
    ],
)
def test_invalid_args_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"DeepSeekV3Args.{field}"):
        replace(TINY, **overrides)


def test_invalid_yarn_scaling_names_the_field():
    with pytest.raises(ValueError, match="beta_fast"):
        YarnScaling(beta_fast=1.0, beta_slow=2.0)
    with pytest.raises(ValueError, match="factor"):
        YarnScaling(factor=0.5)


@pytest.mark.parametrize("args", [TINY, TINY_LOW_RANK_Q], ids=["full_query", "low_rank_query"])
def test_parameter_names_are_torchtitans(args):
    names = set(DeepSeekV3Transformer(args).state_dict())
    query = ("wq_a", "q_norm", "wq_b") if args.q_lora_rank else ("wq",)
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(args.n_layers):
        expected |= {f"layers.{i}.attention.{w}.weight" for w in (*query, "wkv_a", "kv_norm", "wkv_b", "wo")}
        expected |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
        if i < args.n_dense_layers:
            expected |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        else:
            expected |= {f"layers.{i}.moe.experts.{w}" for w in ("w1", "w2", "w3")}
            expected |= {f"layers.{i}.moe.shared_experts.{w}.weight" for w in ("w1", "w2", "w3")}
            expected |= {f"layers.{i}.moe.router.gate.weight", f"layers.{i}.moe.expert_bias"}
    # The routing bias is state a checkpoint keeps; the RoPE table and the load counts are not.
    assert names == expected


@pytest.mark.parametrize("args", [TINY, TINY_LOW_RANK_Q], ids=["full_query", "low_rank_query"])
def test_mla_matches_an_explicit_reference(args):
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(args)
    attention = model.layers["0"].attention
    x = torch.randn(2, 10, args.dim)
    positions = torch.arange(10)
    cache = model.rope_cache[:10]

    def rotate(t):  # interleaved pairs, by the table's (scaled) cos and sin
        cos, sin = cache.chunk(2, dim=-1)
        even, odd = t[..., 0::2], t[..., 1::2]
        cos, sin = cos[:, None], sin[:, None]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    q = attention.wq_b(attention.q_norm(attention.wq_a(x))) if args.q_lora_rank else attention.wq(x)
    q = q.view(2, 10, args.n_heads, args.qk_head_dim)
    q = torch.cat([q[..., : args.qk_nope_head_dim], rotate(q[..., args.qk_nope_head_dim:])], dim=-1)
    latent, k_rope = attention.wkv_a(x).split([args.kv_lora_rank, args.qk_rope_head_dim], dim=-1)
    kv = attention.wkv_b(attention.kv_norm(latent)).view(2, 10, args.n_heads, -1)
    k_nope, v = kv.split([args.qk_nope_head_dim, args.v_head_dim], dim=-1)
    k = torch.cat([k_nope, rotate(k_rope[:, :, None]).expand(-1, -1, args.n_heads, -1)], dim=-1)
    scale = softmax_scale_factor(args.rope_scaling) / math.sqrt(args.qk_head_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    expected = attention.wo(torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(2, 10, -1))
    torch.testing.assert_close(attention(x, model.rope_cache, positions), expected, atol=1e-5, rtol=1e-5)


def test_yarn_table_and_scales():
    scaling = TINY.rope_scaling
    table = precompute_yarn_rope_cache(8, 64, 10000.0, scaling)
    cos, sin = table.chunk(2, dim=-1)
    # Every rotation keeps its length, times the table's factor; position 0 does not rotate.
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, table_scale(scaling) ** 2))
    torch.testing.assert_close(sin[0], torch.zeros(4))
    assert table_scale(scaling) == pytest.approx((0.08 * math.log(4) + 1) / (0.06 * math.log(4) + 1))
    assert softmax_scale_factor(scaling) == pytest.approx((0.06 * math.log(4) + 1) ** 2)
    # The published V3 setting: equal mscales leave the table alone and sharpen the softmax.
    v3 = DEEPSEEK_V3_FLAVORS["671B"].rope_scaling
    assert table_scale(v3) == 1.0 and softmax_scale_factor(v3) == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    # Plain RoPE without scaling: the fastest pair turns one radian per position.
    plain = precompute_yarn_rope_cache(8, 4, 10000.0, None)
    torch.testing.assert_close(plain[1, 0], torch.tensor(math.cos(1.0)))


def test_torchtitans_yarn_rule_and_norm_eps():
    # torchtitan 0.2.2 applies YaRN only when max_seq_len exceeds the original context, gives the latent norms
    # norm_eps and the final norm no eps (its dtype's); TINY's original context is 16.
    args = replace(TINY, rope_scaling_beyond_original_only=True, latent_norm_eps=1e-5, final_norm_dtype_eps=True)
    for max_seq_len, yarn in ((16, False), (17, True)):
        model = DeepSeekV3Transformer(replace(args, max_seq_len=max_seq_len))
        scaling = TINY.rope_scaling if yarn else None
        table = precompute_yarn_rope_cache(TINY.qk_rope_head_dim, max_seq_len, TINY.rope_theta, scaling)
        torch.testing.assert_close(model.rope_cache, table, atol=0, rtol=0)
        query_scale = model.layers["0"].attention.query_scale
        assert query_scale == softmax_scale_factor(scaling) and (query_scale > 1) == yarn
    assert model.layers["0"].attention.kv_norm.eps == 1e-5 and model.norm.eps is None
    x = torch.full((1, TINY.dim), 1e-4)  # mean square 1e-8: the eps (1.2e-7 in float32) dominates
    expected = x * torch.rsqrt(torch.tensor(1e-8 + torch.finfo(torch.float32).eps))
    torch.testing.assert_close(model.norm(x), expected)
    # Hugging Face's rule, the default: YaRN at every length, latent eps 1e-6, the final norm's eps norm_eps.
    model = DeepSeekV3Transformer(replace(TINY, max_seq_len=16))
    assert model.layers["0"].attention.query_scale == softmax_scale_factor(TINY.rope_scaling) > 1
    assert model.layers["0"].attention.kv_norm.eps == 1e-6 and model.norm.eps == TINY.norm_eps


def test_yarn_frequencies_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dtrain.models.deepseek_v3.yarn import yarn_frequencies

    scaling = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.5)
    config = transformers.DeepseekV3Config(
        qk_rope_head_dim=64, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.5},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(yarn_frequencies(64, 10000.0, scaling), inv_freq, rtol=1e-6, atol=0)
    assert table_scale(scaling) == pytest.approx(attention_factor)


def test_meta_init_equals_real_device_init():
    torch.manual_seed(5)
    real = DeepSeekV3Transformer(TINY)
    torch.manual_seed(5)
    real.init_weights()
    with torch.device("meta"):
        abstract = DeepSeekV3Transformer(TINY)
    abstract.to_empty(device="cpu")
    abstract.init_buffers()
    # After to_empty the load counts hold garbage until init_buffers zeroes them; a loaded model needs only that.
    moe_blocks = [b for b in abstract.layers.values() if b.moe is not None]
    assert all(torch.equal(b.moe.tokens_per_expert, torch.zeros(8)) for b in moe_blocks)
    torch.manual_seed(5)
    abstract.init_weights()
    for (name, a), (_, b) in zip(real.state_dict().items(), abstract.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(real.rope_cache, abstract.rope_cache)


def test_pipeline_stages_run_what_they_hold():
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(TINY)
    tokens = _tokens()
    expected = model(tokens)
    first, second = DeepSeekV3Transformer(TINY), DeepSeekV3Transformer(TINY)
    first.load_state_dict(model.state_dict())
    second.load_state_dict(model.state_dict())
    del first.layers["2"]
    first.norm = first.output = None
    del second.layers["0"], second.layers["1"]
    second.tok_embeddings = None
    torch.testing.assert_close(second(first(tokens)), expected)


def test_document_masking_isolates_documents():
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(TINY)
    tokens = _tokens(batch=1, seqlen=20)
    document_ids = (torch.arange(20) >= 8).long()[None]
    packed = model(tokens, document_ids=document_ids)
    # The second document alone, at the same positions, gives the same logits (RoPE sees window positions).
    alone = model(tokens[:, 8:], torch.arange(8, 20))
    torch.testing.assert_close(packed[:, 8:], alone, atol=1e-5, rtol=1e-5)


def test_flops_count_active_parameters_and_both_head_sizes():
    args = DEEPSEEK_V3_FLAVORS["671B"]
    per_token = num_flops_per_token(args, 4096)
    # Attention grows with the context over qk (192) and v (128) features, causal: half of torchtitan's square.
    assert num_flops_per_token(args, 8192) - per_token == 3 * 61 * 128 * (192 + 128) * 4096
    # Routed experts count top_k of num_experts: far below the total's 6 x 671B.
    assert 6 * 36e9 < per_token - 3 * 61 * 128 * 320 * 4096 < 6 * 38e9
    assert DEEPSEEK_V3.flops_per_token is num_flops_per_token


def test_greedy_generation_with_the_kv_cache_equals_decoding_without_it():
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(TINY).eval()
    with torch.no_grad():  # larger weights than the init's, so that greedy choices vary from token to token
        for p in model.parameters():
            p.mul_(8.0 if p.ndim > 1 else 1.0)
    prompt = _tokens(batch=2, seqlen=5)
    new = generate(model, prompt, 12)
    tokens = prompt
    with torch.no_grad():
        for _ in range(12):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, tokens[:, 5:])
    assert len(set(new[0].tolist())) > 2


def test_a_few_training_steps_lower_the_loss():
    torch.manual_seed(0)
    model = DeepSeekV3Transformer(TINY_LOW_RANK_Q)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = _tokens(batch=4, seqlen=33, seed=7)
    inputs, labels = batch[:, :-1], batch[:, 1:]
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    # Every parameter trains: the latent norms, the routed experts and the router among them.
    assert [name for name, p in model.named_parameters() if torch.equal(p, initial[name])] == []


def test_registered_spec_and_its_tp_plan_resolved_per_block():
    from dtrain.parallelize import get_family
    from dtrain.parallelize.tensor_parallel import modules_at, resolve_plan

    spec = get_family("deepseek_v3")
    assert spec.model is DEEPSEEK_V3 and spec.name == "deepseek_v3"
    assert spec.tp_sizes(DEEPSEEK_V3_FLAVORS["671B"]) == {
        "model.n_heads": 128, "the model's vocab size": 129280, "the model's FFN hidden size": 18432,
    }
    # An auxiliary loss only where moe_aux_loss_coeff asks for one (no flavor does: torchtitan's balance by bias).
    assert spec.extra_loss_enabled(replace(DEEPSEEK_V3_FLAVORS["16B"], moe_aux_loss_coeff=1e-3))
    assert not spec.extra_loss_enabled(DEEPSEEK_V3_FLAVORS["16B"])
    with torch.device("meta"):
        model = DeepSeekV3Transformer(TINY_LOW_RANK_Q)
    plan = resolve_plan(spec.tp_plan(sequence_parallel=True, loss_parallel=True), model)
    # Every block has the low-rank query and none the full one; only block 0 (dense) has a feed-forward.
    assert "layers.*.attention.wq_b" in plan and not any(path.endswith("attention.wq") for path in plan)
    assert "layers.0.feed_forward.w1" in plan and "layers.*.feed_forward.w1" not in plan
    assert not any(path.startswith(("layers.1.feed_forward", "layers.2.feed_forward")) for path in plan)
    assert all(modules_at(model, path) for path in plan)


@pytest.mark.cuda
def test_bf16_forward_backward_on_cuda():
    # On CUDA the padded values (model.py) let SDPA pick its flash kernel, which needs one head size for q, k, v.
    with torch.device("meta"):
        model = DeepSeekV3Transformer(TINY_LOW_RANK_Q)
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    model.init_weights()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(_tokens().cuda())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
