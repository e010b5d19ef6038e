"""The DeepSeek-V3 tensor-parallel plan on 2 gloo ranks: the loss and every parameter's gradient equal one
process's, for both query forms, with and without sequence parallel, and with MoE blocks beside dense ones.

What this checks beyond Llama's plan: MLA's per-token projections (the query and kv latents, the rotated key) are
replicated, and the rotated key's gradient, which each rank computes for its own heads only, is summed over the
ranks by ``ReduceGradient``; a plan resolved per block where only some blocks have a feed-forward."""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dtrain.models.deepseek_v3 import DeepSeekV3Args, DeepSeekV3Transformer, YarnScaling

pytestmark = pytest.mark.multiprocess
# The gloo world harness of the parallelize tests (a forkserver shared by the session, timeouts, group teardown).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallelize"))

TINY = DeepSeekV3Args(
    dim=64, n_layers=3, n_dense_layers=3, hidden_dim=96, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, vocab_size=128, max_seq_len=32,
    rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=8, mscale=0.8, mscale_all_dim=0.6),
    moe_num_experts=4, moe_top_k=2, moe_hidden_dim=16, moe_num_shared_experts=1, moe_score_func="sigmoid",
    moe_route_norm=True, moe_load_balance_bias=True,
)
LAYOUTS = {
    "full_query_sp": (TINY, True),
    "low_rank_query_sp": (replace(TINY, q_lora_rank=24), True),
    "low_rank_query": (replace(TINY, q_lora_rank=24), False),
    # MoE blocks (the shared MoE plan, parallelize/moe_tensor_parallel.py): shared experts split, router and
    # routed experts whole on both ranks, on the gathered sequence under sequence parallel.
    "with_moe_blocks": (replace(TINY, n_dense_layers=1), False),
    "with_moe_blocks_sp": (replace(TINY, n_dense_layers=1), True),
}
SEED = 7


def _grads_and_loss(model, tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), model


def tp_layouts(rank: int, world_size: int) -> dict:
    """Every layout in one world: rank 0's (loss, whole gradients, placements) per layout."""
    from torch.distributed.tensor import DTensor

    from dtrain.parallelize import ParallelDims, ParallelizeOptions, build_mesh, get_family
    from dtrain.parallelize import init_weights_like_single_device, model_fqn

    results, meshes = {}, {}
    for name, (args, sequence_parallel) in LAYOUTS.items():
        dims = ParallelDims(world_size, dp_shard=1, tp=2, sequence_parallel=sequence_parallel, loss_parallel=False)
        mesh = meshes.setdefault(sequence_parallel, build_mesh(dims, "cpu"))
        with torch.device("meta"):
            model = DeepSeekV3Transformer(args)
        reference = copy.deepcopy(model)
        get_family("deepseek_v3").parallelize(model, mesh, dims, ParallelizeOptions())
        model.to_empty(device="cpu")
        init_weights_like_single_device(model, reference, SEED)
        tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        loss, model = _grads_and_loss(model, tokens)
        grads = {
            model_fqn(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in model.named_parameters()
        }
        placements = {model_fqn(n): str(getattr(p, "placements", None)) for n, p in model.named_parameters()}
        results[name] = (loss, grads, placements)
    return results


@pytest.fixture(scope="module")
def tp_results() -> dict:
    from dist_harness import run_world

    return run_world(2, tp_layouts)


def _single_process(args: DeepSeekV3Args):
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loss, model = _grads_and_loss(model, tokens)
    return loss, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tp_matches_one_process(tp_results, layout):
    args, _ = LAYOUTS[layout]
    loss, grads, placements = tp_results[layout]
    expected_loss, expected_grads = _single_process(args)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-5)
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    query = "wq_b" if args.q_lora_rank else "wq"
    assert placements[f"layers.0.attention.{query}.weight"] == "(Shard(dim=0),)"
    assert placements["layers.0.attention.wkv_a.weight"] == "(Replicate(),)"
    assert placements["layers.0.attention.wkv_b.weight"] == "(Shard(dim=0),)"
    assert placements["layers.0.attention.wo.weight"] == "(Shard(dim=1),)"
    if args.n_dense_layers < args.n_layers:
        assert placements["layers.1.moe.shared_experts.w1.weight"] == "(Shard(dim=0),)"
        assert placements["layers.1.moe.router.gate.weight"] == "(Replicate(),)"
        assert placements["layers.1.moe.experts.w1"] == "(Replicate(),)"
