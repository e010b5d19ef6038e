"""CUDA-only paths (skipped without a GPU): async TP switches inductor's micro-pipelining on, sharded init runs."""

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
