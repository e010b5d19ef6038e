"""CUDA-only paths (skipped without a GPU): async TP switches inductor's micro-pipelining on, sharded init runs,
context parallel's CUDA attention (torch's ring, and the masked all-gather) is causal attention, and its document
masking (dense and FlexAttention) the dense document mask."""

import os

import pytest
import torch

from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.parallelize import check_async_tp, enable_async_tp, init_weights_sharded

pytestmark = pytest.mark.cuda
ARGS = Llama3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)


def test_async_tp_enables_micro_pipelining(tmp_path):
    import torch.distributed as dist
    from torch._inductor import config as inductor_config
    from torch.distributed.device_mesh import init_device_mesh

    check_async_tp(True, tp=2, device_type="cuda", compile_model=True)
    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        enable_async_tp(init_device_mesh("cuda", (1,), mesh_dim_names=("tp",)))
        assert inductor_config._micro_pipeline_tp
    finally:
        inductor_config._micro_pipeline_tp = False
        dist.destroy_process_group()


def test_sharded_init_of_a_plain_model_is_the_seeded_init():
    with torch.device("meta"):
        model, expected = Transformer(ARGS), Transformer(ARGS)
    model.to_empty(device="cuda")
    expected.to_empty(device="cuda")
    init_weights_sharded(model, seed=3)
    torch.manual_seed(3)
    expected.init_weights()
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        assert torch.equal(got, want), name


@pytest.fixture
def one_rank_cp_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def _attention_and_grads(attention, q, k, v, document_ids=None):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, torch.arange(q.shape[1], device=q.device), document_ids)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("path", ["ring", "masked"])
def test_context_parallel_attention_on_one_cuda_rank_is_causal_attention(one_rank_cp_mesh, path, dtype, tolerance):
    """On one rank the ring and the gather are the identity, so both CUDA paths (torch's ring over the SDPA
    kernels, and the masked all-gather) must give plain causal attention and its gradients (bf16: its rounding)."""
    from dtrain.models.attention import CausalSDPA
    from dtrain.parallelize.context_parallel import cp_attention

    attention = cp_attention(one_rank_cp_mesh, "headtail", "allgather", path)
    q = torch.randn(2, 16, 4, 64, device="cuda", dtype=dtype)
    k, v = torch.randn(2, 16, 2, 64, device="cuda", dtype=dtype), torch.randn(2, 16, 2, 64, device="cuda", dtype=dtype)
    for got, want in zip(_attention_and_grads(attention, q, k, v), _attention_and_grads(CausalSDPA(), q, k, v)):
        torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("path", ["masked", "flex"])
def test_context_parallel_document_masking_on_one_cuda_rank_is_the_dense_mask(one_rank_cp_mesh, path):
    """Packed documents on one cp rank: the gathered keys' dense mask and FlexAttention's block mask both give the
    dense document mask of the whole sequence and its gradients (fp32)."""
    from dtrain.models.attention import CausalSDPA
    from dtrain.parallelize.context_parallel import cp_attention

    attention = cp_attention(one_rank_cp_mesh, "headtail", "allgather", path)
    q = torch.randn(2, 256, 4, 64, device="cuda")
    k, v = torch.randn(2, 256, 2, 64, device="cuda"), torch.randn(2, 256, 2, 64, device="cuda")
    documents = torch.arange(256, device="cuda").div(48, rounding_mode="floor").expand(2, 256)
    expected = _attention_and_grads(CausalSDPA(), q, k, v, documents)
    for got, want in zip(_attention_and_grads(attention, q, k, v, documents), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _ring_rank(rank, world_size, load_balancer, rotate_method, seq=128, dtype=torch.float32):
    """One rank's chunks through torch's ring: its own GPU under NCCL, or all ranks on one GPU with gloo carrying
    the CUDA tensors. seq=128 over 2 ranks gives head-tail chunks of 32 rows (check_cp_divides says why)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dtrain.models.attention import CausalSDPA
    from dtrain.parallelize.context_parallel import chunk_positions, cp_attention

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    q = torch.randn(2, seq, 4, 64, device=device, dtype=dtype)
    k, v = (torch.randn(2, seq, 2, 64, device=device, dtype=dtype) for _ in range(2))
    whole = _attention_and_grads(CausalSDPA(), q, k, v)
    mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("cp",))
    rows = chunk_positions(seq, rank, world_size, load_balancer, device)
    ring = cp_attention(mesh, load_balancer, rotate_method, "ring")
    local = _attention_and_grads(ring, q[:, rows], k[:, rows], v[:, rows])
    return [float((got.float() - want[:, rows].float()).abs().max()) for got, want in zip(local, whole)]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "load_balancer, rotate_method", [("headtail", "allgather"), ("headtail", "alltoall"), ("none", "alltoall")]
)
def test_torchs_ring_attention_over_two_ranks_is_causal_attention(load_balancer, rotate_method):
    """Each rank's chunks (head-tail or plain) through torch's ring: outputs and q/k/v gradients are those rows
    of one causal attention over the whole sequence (fp32; efficient-attention kernel rounding)."""
    from dist_harness import run_world

    two_gpus = torch.cuda.device_count() >= 2
    if not two_gpus and rotate_method == "allgather":
        pytest.skip("gloo's all-gather of CUDA tensors crashed (SIGSEGV; torch 2.11, one H100): needs 2 GPUs, NCCL")
    errors = run_world(2, _ring_rank, load_balancer, rotate_method, backend="nccl" if two_gpus else "gloo")
    assert max(errors) < 1e-4, errors
