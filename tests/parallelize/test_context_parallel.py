"""Context parallel's pieces on one process: which tokens each cp rank holds, which attention a rank runs where,
and that attention over gathered keys (with a positional mask, or block by block) is the causal attention of the
whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtrain.models.attention import CausalSDPA, repeat_kv
from dtrain.parallelize.blockwise_attention import BlockCausalAttention
from dtrain.parallelize import ParallelDims, ParallelismError, ParallelizeOptions
from dtrain.parallelize.context_parallel import (
    chunk_blocks,
    chunk_positions,
    cp_attention_path,
    gathered_positions,
    in_position_order,
    masked_attention,
    shard_sequence,
)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("load_balancer", ["headtail", "none"])
def test_the_cp_ranks_hold_every_position_once(cp, load_balancer):
    held = torch.cat([chunk_positions(32, rank, cp, load_balancer) for rank in range(cp)])
    assert sorted(held.tolist()) == list(range(32))
    assert torch.equal(held, gathered_positions(32 // cp, cp, load_balancer, None))


def test_headtail_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i():
    assert chunk_positions(16, 0, 2, "headtail").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 1, 2, "headtail").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert chunk_positions(16, 1, 2, "none").tolist() == list(range(8, 16))


def test_headtail_balances_causal_attention_work():
    """Each query attends to (its position + 1) keys: head-tail gives every rank the same total, plain chunks do not."""
    def work(load_balancer):
        return [int((chunk_positions(64, r, 4, load_balancer) + 1).sum()) for r in range(4)]
    assert len(set(work("headtail"))) == 1
    assert work("none")[-1] > 3 * work("none")[0]


def test_shard_sequence_keeps_the_same_tokens_of_inputs_and_labels():
    batch = {"input_ids": torch.arange(32).reshape(2, 16), "labels": torch.arange(32).reshape(2, 16) + 100}
    local = shard_sequence(batch, 1, 2, "headtail")
    assert local["input_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(local["labels"], local["input_ids"] + 100)


@pytest.mark.parametrize("load_balancer", ["headtail", "none"])
def test_masked_attention_over_gathered_keys_is_causal_attention(load_balancer):
    """The off-CPU path, with the all-gather done by hand: each rank's queries over the keys in rank order."""
    torch.manual_seed(0)
    cp, seq = 2, 16
    q, k, v = torch.randn(2, seq, 4, 8), torch.randn(2, seq, 2, 8), torch.randn(2, seq, 2, 8)
    whole = CausalSDPA()(q, k, v, torch.arange(seq))
    order = gathered_positions(seq // cp, cp, load_balancer, None)
    for rank in range(cp):
        positions = chunk_positions(seq, rank, cp, load_balancer)
        out = masked_attention(q[:, positions], k[:, order], v[:, order], positions[:, None] >= order[None, :])
        torch.testing.assert_close(out, whole[:, positions], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "device_type, attention_mask, path",
    [
        ("cuda", "causal", "ring"),
        ("cpu", "causal", "blockwise"),
        ("cuda", "block_causal", "masked"),
        ("cpu", "block_causal", "masked"),
        ("xpu", "causal", "masked"),
    ],
)
def test_cp_attention_path_is_torchs_ring_on_cuda_with_a_causal_mask_only(device_type, attention_mask, path):
    assert cp_attention_path(device_type, attention_mask) == path


@pytest.mark.parametrize(
    "device_type, attention_mask, refused",
    [("cuda", "causal", False), ("cpu", "causal", True), ("cuda", "block_causal", True)],
)
def test_alltoall_rotation_is_valid_only_on_torchs_ring(device_type, attention_mask, refused):
    options = ParallelizeOptions(device_type=device_type, cp_rotate_method="alltoall", attention_mask=attention_mask)
    dims = ParallelDims(dp_shard=1, cp=2, world_size=2)
    if refused:
        with pytest.raises(ParallelismError, match="context_parallel_rotate_method='alltoall' needs torch's ring"):
            options.validate(dims)
    else:
        options.validate(dims)


@pytest.mark.parametrize("load_balancer", ["headtail", "none"])
def test_masked_attention_keeps_each_document_to_itself(load_balancer):
    """Under document masking each rank's queries see only earlier keys of their own document: the same as
    attending within each document alone."""
    torch.manual_seed(0)
    cp, seq = 2, 16
    q, k, v = torch.randn(1, seq, 4, 8), torch.randn(1, seq, 2, 8), torch.randn(1, seq, 2, 8)
    documents = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
    bounds = [(0, 5), (5, 12), (12, 16)]
    whole = torch.cat([CausalSDPA()(q[:, a:b], k[:, a:b], v[:, a:b], torch.arange(b - a)) for a, b in bounds], 1)
    order = gathered_positions(seq // cp, cp, load_balancer, None)
    for rank in range(cp):
        positions = chunk_positions(seq, rank, cp, load_balancer)
        allowed = (positions[:, None] >= order[None, :]) & (documents[positions][:, None] == documents[order][None, :])
        out = masked_attention(q[:, positions], k[:, order], v[:, order], allowed)
        torch.testing.assert_close(out, whole[:, positions], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("load_balancer", ["headtail", "none"])
def test_gathered_blocks_go_back_to_position_order(load_balancer):
    cp, seq = 4, 32
    gathered = gathered_positions(seq // cp, cp, load_balancer, None)
    assert in_position_order(gathered[None], cp, load_balancer)[0].tolist() == list(range(seq))


@pytest.mark.parametrize("cp, load_balancer", [(2, "headtail"), (4, "headtail"), (2, "none")])
def test_blockwise_attention_gives_causal_attention_and_its_gradients(cp, load_balancer):
    """Each rank's chunks over the whole sequence's keys (grouped-query: 2 kv heads for 4 query heads), block by
    block without a mask: outputs and the gradients of q, k and v (summed over the ranks) are those of one
    causal attention, to fp32 rounding."""
    torch.manual_seed(0)
    seq = 32
    q = torch.randn(2, 4, seq, 8, requires_grad=True)
    k, v = torch.randn(2, 2, seq, 8, requires_grad=True), torch.randn(2, 2, seq, 8, requires_grad=True)
    whole = F.scaled_dot_product_attention(q, repeat_kv_heads(k), repeat_kv_heads(v), is_causal=True)
    grad = torch.randn_like(whole)
    expected = torch.autograd.grad(whole, (q, k, v), grad)
    grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        rows = chunk_positions(seq, rank, cp, load_balancer)
        q_local = q.detach()[:, :, rows].requires_grad_()
        k_all, v_all = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = BlockCausalAttention.apply(q_local, k_all, v_all, chunk_blocks(rank, cp, load_balancer))
        torch.testing.assert_close(out, whole.detach()[:, :, rows], rtol=1e-5, atol=1e-6)
        out.backward(grad[:, :, rows])
        grad_q[:, :, rows] += q_local.grad
        grad_k += k_all.grad
        grad_v += v_all.grad
    for got, want in zip((grad_q, grad_k, grad_v), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def repeat_kv_heads(x: torch.Tensor) -> torch.Tensor:
    """[b, kv_heads, s, d] with each kv head repeated for 2 query heads, as repeat_kv does along dim 2."""
    return repeat_kv(x.transpose(1, 2), 2).transpose(1, 2)


@pytest.fixture
def one_rank_cp_mesh(tmp_path):
    """A world of one gloo process and its cp mesh; afterwards torch's process-wide CP dispatcher is off again."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import _attention

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    finally:
        _attention._disable_context_parallel_dispatcher()
        _attention._cp_options.enable_load_balance = True
        _attention.set_rotate_method("allgather")
        dist.destroy_process_group()


@pytest.mark.parametrize("load_balancer, rotate_method", [("headtail", "alltoall"), ("none", "allgather")])
def test_ring_attention_is_torchs_context_parallel_style_which_has_no_cpu_kernel(
    one_rank_cp_mesh, load_balancer, rotate_method
):
    """The CUDA path builds on CPU too (torch's private CP API is where dtrain expects it, on both torches) and
    sets torch's options from dtrain's keys; running it on CPU fails in torch, which is why CPU takes the
    blockwise path. If torch ever adds a CPU rule, this test says so and the selection can be revisited."""
    from torch.distributed.tensor.experimental import _attention

    from dtrain.parallelize.ring_attention import RingAttention

    attention = RingAttention(one_rank_cp_mesh, load_balancer, rotate_method)
    assert attention.kernel._forward_pre_hooks and attention.kernel._forward_hooks
    assert _attention._cp_options.enable_load_balance == (load_balancer == "headtail")
    rotation = {"alltoall": "ALL_TO_ALL", "allgather": "ALL_GATHER"}[rotate_method]
    assert _attention._cp_options.rotate_method.name == rotation
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    with pytest.raises(NotImplementedError, match="flash_attention_for_cpu"):
        attention(q, k, v, torch.arange(8))


@torch.no_grad()
def test_flex_document_masking_over_gathered_keys_is_the_dense_mask(one_rank_cp_mesh):
    """The CUDA document-masking path's block mask over a cp rank's query positions and the gathered key positions
    and documents (forward only here: FlexAttention has no CPU backward; tests/parallelize/test_cuda.py runs both)."""
    from dtrain.parallelize.context_parallel import cp_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 256, 4, 8), torch.randn(2, 256, 2, 8), torch.randn(2, 256, 2, 8)
    documents = torch.arange(256).div(48, rounding_mode="floor").expand(2, 256)
    flex = cp_attention(one_rank_cp_mesh, "headtail", "allgather", "flex")
    expected = CausalSDPA()(q, k, v, torch.arange(256), documents)
    torch.testing.assert_close(flex(q, k, v, torch.arange(256), documents), expected, rtol=1e-5, atol=1e-5)
