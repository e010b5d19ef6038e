"""The Mixture-of-Experts layer: names and shapes, the output against a per-token reference and against Hugging
Face's Qwen3-MoE and DeepSeek-V3 blocks, grouped GEMM against the per-expert loop, gradients, load counting, the
auxiliary loss (and its shares over ranks), loss-free balancing, the expert-parallel seam (``moe.experts``) and
meta-device construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtrain.models.moe import (
    GroupedExperts,
    MoE,
    MoEArgs,
    _experts_grouped_mm,
    _experts_loop,
    _grouped_mm_runs,
    moe_params_per_token,
    run_experts,
    update_expert_bias,
)

DIM = 16
SOFTMAX = MoEArgs(num_experts=8, top_k=2, hidden_dim=24, num_shared_experts=1, route_norm=True)
# DeepSeek-V3's routing in miniature: 4 groups of 4 experts, each token picks 3 experts within its best 2 groups.
SIGMOID = MoEArgs(num_experts=16, top_k=3, hidden_dim=24, num_shared_experts=2, score_func="sigmoid", route_norm=True,
                  route_scale=2.5, num_expert_groups=4, num_limited_groups=2, load_balance_bias=True)


def build(args: MoEArgs, dim: int = DIM, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(args, dim)
    moe.init_weights(init_std=0.1, out_std=0.25)  # the gate takes out_std: routing logits of std ~1 vary visibly
    if moe.expert_bias is not None:
        moe.expert_bias.copy_(torch.randn(args.num_experts) * 0.1)  # a bias that changes some selections
    return moe


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def reference_route(scores: torch.Tensor, bias: torch.Tensor | None, args: MoEArgs) -> tuple[list[int], torch.Tensor]:
    """One token's experts and combine weights, spelled out: bias for choice only, best groups by top-2 sums."""
    choice = scores if bias is None else scores + bias
    per_group = args.num_experts // args.num_expert_groups
    top2_sums = [sum(sorted(choice[g * per_group:(g + 1) * per_group].tolist())[-2:])
                 for g in range(args.num_expert_groups)]
    best_groups = sorted(range(args.num_expert_groups), key=lambda g: -top2_sums[g])[:args.num_limited_groups]
    allowed = [e for e in range(args.num_experts) if e // per_group in best_groups or args.num_expert_groups == 1]
    experts = sorted(allowed, key=lambda e: -choice[e].item())[:args.top_k]
    weights = scores[experts]
    if args.route_norm:
        weights = weights / weights.sum()
    return experts, weights * args.route_scale


def reference_moe(moe: MoE, args: MoEArgs, x: torch.Tensor) -> torch.Tensor:
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ moe.router.gate.weight.T
    all_scores = logits.softmax(-1) if args.score_func == "softmax" else logits.sigmoid()
    ex, shared = moe.experts, moe.shared_experts
    rows = []
    for token, scores in zip(tokens, all_scores):
        experts, weights = reference_route(scores, moe.expert_bias, args)
        out = sum(w * swiglu(token, ex.w1[e], ex.w2[e], ex.w3[e]) for e, w in zip(experts, weights))
        if shared is not None:
            out = out + swiglu(token, shared.w1.weight, shared.w2.weight, shared.w3.weight)
        rows.append(out)
    return torch.stack(rows).view(x.shape)


def test_names_shapes_and_state_dict():
    moe = MoE(SIGMOID, DIM)
    shapes = {name: tuple(p.shape) for name, p in moe.named_parameters()}
    assert shapes == {
        "router.gate.weight": (16, DIM),
        "experts.w1": (16, 24, DIM),
        "experts.w2": (16, DIM, 24),
        "experts.w3": (16, 24, DIM),
        "shared_experts.w1.weight": (48, DIM),
        "shared_experts.w2.weight": (DIM, 48),
        "shared_experts.w3.weight": (48, DIM),
    }
    assert set(moe.state_dict()) == set(shapes) | {"expert_bias"}  # tokens_per_expert is not persistent
    assert moe.expert_bias.dtype == moe.tokens_per_expert.dtype == torch.float32
    assert moe.tokens_per_expert.shape == (16,)

    plain = MoE(MoEArgs(num_experts=4, top_k=1, hidden_dim=8), DIM)
    assert plain.shared_experts is None and plain.expert_bias is None
    assert set(plain.state_dict()) == {"router.gate.weight", "experts.w1", "experts.w2", "experts.w3"}
    assert dict(plain.named_buffers()).keys() == {"tokens_per_expert"}


@pytest.mark.parametrize("args", [SOFTMAX, SIGMOID], ids=["softmax", "sigmoid-groups-bias"])
def test_output_matches_per_token_reference(args):
    moe = build(args)
    x = torch.randn(2, 7, DIM)
    out = moe(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, reference_moe(moe, args, x), rtol=0, atol=1e-6)


def test_bias_changes_selection_but_not_combine_weights():
    moe = build(SIGMOID)
    tokens = torch.randn(32, DIM)
    weights, experts, scores = moe.router(tokens, moe.expert_bias)
    unbiased_weights, unbiased_experts, _ = moe.router(tokens, None)
    assert not torch.equal(experts, unbiased_experts)  # the bias above is large enough to move some choices
    chosen = scores.gather(1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5)


def test_group_limited_routing_stays_within_the_best_groups():
    moe = build(SIGMOID)
    tokens = torch.randn(64, DIM)
    _, experts, _ = moe.router(tokens, moe.expert_bias)
    groups_per_token = [len(set(row)) for row in (experts // 4).tolist()]
    assert max(groups_per_token) <= 2 and experts.dtype == torch.int64
    # Experts outside the best groups are masked with -inf (as Hugging Face's DeepSeek-V3 does), not 0.0: with every
    # biased score negative, 0.0 would pick masked experts; -inf keeps the choice that a uniform shift cannot change.
    _, shifted_experts, _ = moe.router(tokens, moe.expert_bias - 2.0)
    assert torch.equal(shifted_experts, experts)


@pytest.mark.parametrize("route_norm", [False, True])
def test_route_norm_and_route_scale(route_norm):
    args = MoEArgs(num_experts=8, top_k=3, hidden_dim=8, route_norm=route_norm, route_scale=1.5)
    moe = build(args)
    weights, experts, scores = moe.router(torch.randn(10, DIM), None)
    assert weights.dtype == scores.dtype == torch.float32 and weights.shape == (10, 3) and scores.shape == (10, 8)
    chosen = scores.gather(1, experts)
    if route_norm:
        torch.testing.assert_close(weights.sum(-1), torch.full((10,), 1.5))
    else:
        torch.testing.assert_close(weights, chosen * 1.5)


def to_hf_experts(moe: MoE, hf_experts: torch.nn.Module) -> None:
    # HF fuses the gate and up projections: gate_up_proj = [w1; w3] along the hidden dimension.
    hf_experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
    hf_experts.down_proj.copy_(moe.experts.w2)


@torch.no_grad()
def test_matches_hugging_face_qwen3_moe_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=24, route_norm=True)
    moe = build(args)
    config = transformers.Qwen3MoeConfig(hidden_size=DIM, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True)
    hf = Qwen3MoeSparseMoeBlock(config)
    hf.gate.weight.copy_(moe.router.gate.weight)
    to_hf_experts(moe, hf.experts)
    x = torch.randn(2, 9, DIM)
    torch.testing.assert_close(moe(x), hf(x), rtol=0, atol=1e-6)


@torch.no_grad()
def test_matches_hugging_face_deepseek_v3_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    moe = build(SIGMOID)
    config = transformers.DeepseekV3Config(hidden_size=DIM, moe_intermediate_size=24, n_routed_experts=16,
                                           num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
                                           norm_topk_prob=True, routed_scaling_factor=2.5)
    hf = DeepseekV3MoE(config)
    hf.gate.weight.copy_(moe.router.gate.weight)
    hf.gate.e_score_correction_bias.copy_(moe.expert_bias)
    to_hf_experts(moe, hf.experts)
    for ours, theirs in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
        getattr(hf.shared_experts, theirs).weight.copy_(getattr(moe.shared_experts, ours).weight)
    x = torch.randn(2, 9, DIM)
    torch.testing.assert_close(moe(x), hf(x), rtol=0, atol=1e-6)


def forward_backward(path, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    experts.zero_grad()
    out = path(x, counts, experts.w1.to(x.dtype), experts.w2.to(x.dtype), experts.w3.to(x.dtype))
    out.backward(torch.ones_like(out))
    return [out.detach(), x.grad, experts.w1.grad.clone(), experts.w2.grad.clone(), experts.w3.grad.clone()]


@pytest.mark.parametrize("device, dtype", [
    ("cpu", torch.float32),
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),
])
def test_grouped_mm_path_equals_loop_path(device, dtype):
    x = torch.randn(40, DIM, device=device, dtype=dtype)
    if not hasattr(torch, "_grouped_mm") or not _grouped_mm_runs(x, hidden_dim=24):
        pytest.skip(f"torch._grouped_mm does not run for {dtype} on this {device}")
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, 24, num_experts=5).to(device)
    experts.init_weights(0.5, 0.5)
    counts = torch.tensor([9, 0, 17, 1, 13], device=device)  # an idle expert too
    grouped = forward_backward(_experts_grouped_mm, experts, x, counts)
    loop = forward_backward(_experts_loop, experts, x, counts)
    tolerance = dict(rtol=1.3e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for a, b in zip(grouped, loop):
        torch.testing.assert_close(a, b, **tolerance)


def test_grouped_mm_needs_16_byte_rows():
    # dim 6 in float32 is 24-byte rows: torch._grouped_mm refuses them, so the loop runs and still gives a result.
    assert not _grouped_mm_runs(torch.zeros(4, 6), hidden_dim=8)
    experts = GroupedExperts(6, 8, num_experts=2)
    experts.init_weights(0.5, 0.5)
    assert experts(torch.randn(5, 6), torch.tensor([2, 3])).shape == (5, 6)


def test_experts_take_their_number_from_the_weights_and_counts():
    # Under expert parallelism a rank runs only its local experts (a slice of the weights) on local counts.
    experts = GroupedExperts(DIM, 24, num_experts=4)
    experts.init_weights(0.5, 0.5)
    x = torch.randn(7, DIM)
    local = run_experts(x, torch.tensor([4, 0, 3]), experts.w1[1:], experts.w2[1:], experts.w3[1:])
    torch.testing.assert_close(local[4:], swiglu(x[4:], experts.w1[3], experts.w2[3], experts.w3[3]), rtol=0, atol=1e-6)
    full = experts(x, torch.tensor([0, 4, 0, 3]))
    torch.testing.assert_close(full, local, rtol=0, atol=1e-6)


def test_gradients_reach_gate_experts_shared_experts_and_input():
    moe = build(MoEArgs(num_experts=4, top_k=2, hidden_dim=8, num_shared_experts=1, aux_loss_coeff=0.0))
    x = torch.randn(2, 12, DIM, requires_grad=True)
    moe(x).square().sum().backward()
    for name, param in [*moe.named_parameters(), ("x", x)]:
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_tokens_per_expert_counts_the_selections_and_accumulates():
    moe = build(SIGMOID)
    x = torch.randn(3, 5, DIM)
    moe(x)
    _, experts, _ = moe.router(x.view(-1, DIM), moe.expert_bias)
    expected = torch.bincount(experts.flatten(), minlength=16).float()
    assert torch.equal(moe.tokens_per_expert, expected) and expected.sum() == 15 * 3
    moe(x)
    assert torch.equal(moe.tokens_per_expert, 2 * expected)


def test_aux_loss_matches_a_hand_computation_and_trains_the_gate():
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=8, aux_loss_coeff=0.01)
    moe = build(args).train()
    x = torch.randn(2, 6, DIM)
    moe(x)
    probabilities = (x.view(-1, DIM) @ moe.router.gate.weight.T).softmax(-1)
    chosen = probabilities.topk(2, dim=-1).indices
    fraction = torch.stack([(chosen == i).sum() for i in range(4)]).float() / 12  # selections per token
    expected = 0.01 * 4 * (fraction * probabilities.mean(0)).sum()
    assert moe.aux_loss.dtype == torch.float32 and moe.aux_loss.dim() == 0
    torch.testing.assert_close(moe.aux_loss, expected)
    moe.aux_loss.backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0

    moe.eval()
    moe(x)
    assert moe.aux_loss is None
    no_aux = build(MoEArgs(num_experts=4, top_k=2, hidden_dim=8)).train()
    no_aux(x)
    assert no_aux.aux_loss is None


def test_aux_loss_shares_of_two_ranks_add_up_to_the_whole_batch_loss_and_gradient():
    """Two "ranks" each route half of a batch; their count reduction (the seam parallelize sets to an all-reduce)
    adds the other half's counts. Their shares then sum to one process's loss on the whole batch, and so do their
    gradients, as data parallel sums them."""
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=8, aux_loss_coeff=0.01)
    whole = build(args).train()
    x = torch.randn(4, 6, DIM)
    whole(x)
    whole.aux_loss.backward()
    halves = x.chunk(2)
    counts = []
    for half in halves:
        layer = build(args).train()
        layer(half)
        counts.append(layer.tokens_per_expert.clone())
    shares, grads = [], []
    for rank, half in enumerate(halves):
        layer = build(args).train()
        other = counts[1 - rank]
        layer.reduce_expert_counts = lambda local, other=other: local + other
        layer(half)
        layer.aux_loss.backward()
        shares.append(layer.aux_loss.detach())
        grads.append(layer.router.gate.weight.grad)
    torch.testing.assert_close(shares[0] + shares[1], whole.aux_loss.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[0] + grads[1], whole.router.gate.weight.grad, rtol=1e-5, atol=1e-9)
    # Without the reduction each half's own statistics give another loss: the layout would show in the curve.
    alone = build(args).train()
    alone(halves[0])
    assert not torch.allclose(alone.aux_loss, 2 * shares[0], rtol=1e-3)


def test_update_expert_bias_favours_underloaded_experts_and_resets_the_counts():
    moe = build(SIGMOID)
    moe.expert_bias.zero_()
    moe(torch.randn(4, 8, DIM))
    load = moe.tokens_per_expert.clone()
    update_expert_bias(moe, load)
    mean = load.mean()
    step = 1e-3 * torch.sign(mean - load)
    expected = step - step.mean()  # torchtitan's update: the change is centred, so the bias keeps mean zero
    assert torch.equal(moe.expert_bias, expected) and abs(float(moe.expert_bias.mean())) < 1e-9
    assert (moe.expert_bias[load < mean] > 0).all() and (moe.expert_bias[load > mean] < 0).all()
    assert moe.tokens_per_expert.sum() == 0
    # Recomputation under activation checkpointing doubles every count: the update does not change.
    moe.expert_bias.zero_()
    update_expert_bias(moe, 2 * load)
    assert torch.equal(moe.expert_bias, expected)
    with pytest.raises(ValueError, match="load_balance_bias"):
        update_expert_bias(build(SOFTMAX), load)


def test_experts_call_is_the_only_path_of_the_routed_tokens():
    args = MoEArgs(num_experts=4, top_k=2, hidden_dim=8)
    moe = build(args)
    x = torch.randn(2, 5, DIM)
    seen = {}

    def record_and_zero(module, inputs, output):
        seen["inputs"] = inputs
        return torch.zeros_like(output)

    handle = moe.experts.register_forward_hook(record_and_zero)
    out = moe(x)
    handle.remove()
    routed_input, counts = seen["inputs"]
    assert routed_input.shape == (10 * 2, DIM) and counts.shape == (4,) and counts.dtype == torch.int64
    assert torch.equal(counts.float(), moe.tokens_per_expert)
    assert torch.equal(out, torch.zeros_like(x))  # no shared experts: everything went through the hooked call

    # The rows are grouped by expert, in expert order, each group in token order (a stable sort).
    _, experts, _ = moe.router(x.view(-1, DIM), None)
    expected_rows = [t for e in range(4) for t in range(10) for slot in range(2) if experts[t, slot] == e]
    assert torch.equal(routed_input, x.view(-1, DIM)[expected_rows])


def test_a_hook_may_replace_the_experts_inputs():
    # Expert parallelism swaps in the tokens this rank's experts receive; here: the same tokens, all to expert 0.
    moe = build(MoEArgs(num_experts=4, top_k=1, hidden_dim=8))
    x = torch.randn(1, 6, DIM)
    handle = moe.experts.register_forward_pre_hook(lambda module, args: (args[0], torch.tensor([6, 0, 0, 0])))
    out = moe(x)
    handle.remove()
    weights, experts, _ = moe.router(x.view(-1, DIM), None)
    order = torch.argsort(experts.flatten(), stable=True)
    expert0 = swiglu(x.view(-1, DIM), moe.experts.w1[0], moe.experts.w2[0], moe.experts.w3[0])
    torch.testing.assert_close(out.view(-1, DIM)[order], expert0[order] * weights[order], rtol=0, atol=1e-6)


def test_bf16_input_keeps_its_dtype_with_a_float32_router():
    moe = build(SOFTMAX)
    x = torch.randn(2, 4, DIM)
    out = moe.to(torch.bfloat16)(x.bfloat16())
    weights, _, scores = moe.router(x.view(-1, DIM).bfloat16(), None)
    assert out.dtype == torch.bfloat16 and weights.dtype == scores.dtype == torch.float32


def test_meta_construction_then_to_empty_and_init_weights():
    with torch.device("meta"):
        moe = MoE(SIGMOID, DIM)
    moe.to_empty(device="cpu")
    moe.expert_bias.fill_(float("nan"))
    moe.tokens_per_expert.fill_(float("nan"))
    torch.manual_seed(0)
    moe.init_weights(init_std=0.02, out_std=0.01)
    assert moe.expert_bias.eq(0).all() and moe.tokens_per_expert.eq(0).all()
    for name, param in moe.named_parameters():
        assert torch.isfinite(param).all(), name
    assert moe.experts.w1.std().item() == pytest.approx(0.02, rel=0.1)
    assert moe.experts.w2.std().item() == pytest.approx(0.01, rel=0.1)
    assert moe.router.gate.weight.std().item() == pytest.approx(0.01, rel=0.2)  # the gate takes out_std
    assert torch.isfinite(moe(torch.randn(1, 3, DIM))).all()


def test_params_per_token():
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=24, num_shared_experts=2)
    assert moe_params_per_token(args, DIM) == DIM * 8 + 2 * 3 * DIM * 24 + 3 * DIM * 24 * 2


@pytest.mark.parametrize("overrides, field", [
    (dict(num_experts=0), "num_experts"),
    (dict(top_k=9), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(hidden_dim=0), "hidden_dim"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(score_func="relu"), "score_func"),
    (dict(route_scale=0.0), "route_scale"),
    (dict(num_expert_groups=3), "num_expert_groups"),
    (dict(num_expert_groups=8), "num_expert_groups"),  # one expert per group: no top-2 group score
    (dict(num_expert_groups=4, num_limited_groups=5), "num_limited_groups"),
    (dict(num_expert_groups=4, num_limited_groups=1, top_k=3), "top_k"),  # 2 experts reachable
    (dict(aux_loss_coeff=-1.0), "aux_loss_coeff"),
    (dict(bias_update_speed=-1.0), "bias_update_speed"),
])
def test_invalid_args_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        MoEArgs(**overrides)


@pytest.mark.slow
def test_compiles_without_graph_breaks_in_bf16():
    # fullgraph: no host sync and no data-dependent Python control flow in the forward (bf16 takes grouped_mm).
    moe = build(MoEArgs(num_experts=4, top_k=2, hidden_dim=16, num_shared_experts=1, aux_loss_coeff=0.01))
    moe.to(torch.bfloat16).train()
    x = torch.randn(2, 6, DIM, dtype=torch.bfloat16)
    expected = moe(x)
    compiled = torch.compile(moe, fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
    out.float().sum().backward()
    assert moe.experts.w1.grad is not None and moe.aux_loss is not None


def test_under_autocast_the_router_stays_float32_and_the_experts_compute_in_bf16():
    moe = build(SOFTMAX)
    x = torch.randn(2, 4, DIM)
    expected_out = moe(x)
    _, _, expected_scores = moe.router(x.view(-1, DIM), None)
    seen = {}
    moe.experts.register_forward_hook(lambda module, inputs, output: seen.update(output=output))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
        _, _, scores = moe.router(x.view(-1, DIM), None)
    assert torch.equal(scores, expected_scores)
    assert seen["output"].dtype == torch.bfloat16 and out.dtype == torch.float32
    torch.testing.assert_close(out, expected_out, rtol=0, atol=2e-2)
