"""CUDA-only paths (skipped without a GPU): async TP switches inductor's micro-pipelining on, sharded init runs,
context parallel's attention takes its off-CPU (masked) path and is causal attention."""

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


def test_context_parallel_attention_on_cuda_is_causal_attention(tmp_path):
    """On one rank the all-gather is the identity, so the off-CPU path must give plain causal attention."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtrain.models.attention import CausalSDPA
    from dtrain.parallelize.context_parallel import AllGatherKVAttention

    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        attention = AllGatherKVAttention(init_device_mesh("cuda", (1,), mesh_dim_names=("cp",)), "none")
        q = torch.randn(2, 16, 4, 8, device="cuda", requires_grad=True)
        k, v = torch.randn(2, 16, 2, 8, device="cuda"), torch.randn(2, 16, 2, 8, device="cuda")
        positions = torch.arange(16, device="cuda")
        out = attention(q, k, v, positions)
        torch.testing.assert_close(out, CausalSDPA()(q, k, v, positions), rtol=1e-4, atol=1e-5)
        out.sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()
    finally:
        dist.destroy_process_group()
