"""Everything of dtrain.parallelize that needs no process group: options, plans, AC, init, memory, helpers."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.parallelize import (
    SAC_SAVE_OPS,
    ParallelDims,
    ParallelismError,
    ParallelizeOptions,
    apply_ac,
    build_mesh,
    check_async_tp,
    format_tp_plan,
    init_weights_like_single_device,
    init_weights_sharded,
    local_loss,
    loss_parallel_context,
    memory_footprint,
    model_fqn,
)
from dtrain.parallelize.llama3 import llama3_tp_plan, parallelize_llama
from dtrain.run.world import backend_for, dp_rank_and_size, sum_over_dp

ARGS = Llama3Args(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)
aten = torch.ops.aten


def meta_model(args=ARGS):
    with torch.device("meta"):
        return Transformer(args)


@pytest.mark.parametrize(
    "options, key",
    [
        (dict(param_dtype="float64"), "training.mixed_precision_param='float64'"),
        (dict(reduce_dtype="int8"), "training.mixed_precision_reduce='int8'"),
        (dict(reshard_after_forward="sometimes"), "parallelism.fsdp_reshard_after_forward='sometimes'"),
        (dict(ac_mode="partial"), "activation_checkpoint.mode='partial'"),
        (dict(ac_mode="selective", selective_ac_option="x"), "activation_checkpoint.selective_ac_option='x'"),
        (dict(ac_mode="selective", selective_ac_option="0"), "activation_checkpoint.selective_ac_option='0'"),
        (dict(cpu_offload=True), "training.enable_cpu_offload"),
        (
            dict(ac_mode="memory_budget", memory_budget=1.5, compile_model=True),
            "activation_checkpoint.memory_budget=1.5",
        ),
        (dict(ac_mode="memory_budget"), "activation_checkpoint.mode='memory_budget' is applied by torch.compile"),
        (
            dict(ac_mode="memory_budget", compile_model=True, compile_backend="aot_eager"),
            "activation_checkpoint.mode='memory_budget' is ignored by compile.backend='aot_eager'",
        ),
    ],
)
def test_invalid_options_name_their_key(options, key):
    with pytest.raises(ParallelismError) as error:
        ParallelizeOptions(**options).validate(ParallelDims(2, dp_replicate=2, dp_shard=1))
    assert key in str(error.value) and "\n" not in str(error.value)


def test_valid_options_pass():
    ParallelizeOptions(param_dtype="bfloat16", ac_mode="selective", selective_ac_option="op").validate(ParallelDims(2))


def test_async_tp_refused_on_cpu_in_one_line():
    dims = ParallelDims(2, dp_shard=1, tp=2)
    options = ParallelizeOptions(device_type="cpu", compile_model=True, async_tp=True)
    with pytest.raises(ParallelismError, match=r"^parallelism.enable_async_tensor_parallel needs CUDA GPUs with NCCL"):
        options.validate(dims)
    with pytest.raises(ParallelismError, match="tensor_parallel_degree > 1"):
        check_async_tp(True, tp=1, device_type="cuda", compile_model=True)
    check_async_tp(False, tp=1, device_type="cpu", compile_model=False)


def test_async_tp_needs_compile(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    with pytest.raises(ParallelismError, match="compile.enable"):
        check_async_tp(True, tp=2, device_type="cuda", compile_model=False)
    check_async_tp(True, tp=2, device_type="cuda", compile_model=True)


def test_tp_plan_is_printable_data():
    plan = llama3_tp_plan()
    text = format_tp_plan(plan)
    lines = dict(line.split(None, 1) for line in text.splitlines())
    assert set(lines) == set(plan)
    assert lines["tok_embeddings"] == "SyncOutputRowwiseParallel(in=R, out=S(1), local_output=True)"
    assert lines["layers.*.attention.wq"].startswith("ColwiseParallel(")
    assert lines["layers.*.attention.wo"].startswith("RowwiseParallel(in=S(-1), out=S(1)")
    assert lines["layers.*.attention"] == (
        "PrepareModuleInput(in=(S(1), None, None, None), desired_in=(R, None, None, None), local_output=False)"
    )
    assert lines["output"] == "ColwiseParallel(in=S(1), desired_in=R, out=S(-1), local_output=False)"


def test_tp_plan_without_sequence_or_loss_parallel():
    plan = llama3_tp_plan(sequence_parallel=False, loss_parallel=False)
    assert "layers.*.attention" not in plan and "layers.*.feed_forward" not in plan
    lines = dict(line.split(None, 1) for line in format_tp_plan(plan).splitlines())
    assert lines["layers.*.ffn_norm"] == lines["norm"] == "ReplicateParallel()"
    assert lines["layers.*.attention.wo"].startswith("RowwiseParallel(in=S(-1), out=R")
    assert lines["output"] == "ColwiseParallel(in=R, desired_in=R, out=R, local_output=True)"


def test_loss_parallel_context_only_under_tp():
    assert isinstance(loss_parallel_context(ParallelDims(2)), contextlib.nullcontext)
    assert not isinstance(loss_parallel_context(ParallelDims(2, dp_shard=1, tp=2)), contextlib.nullcontext)
    assert isinstance(loss_parallel_context(ParallelDims(2, dp_shard=1, tp=2, loss_parallel=False)), contextlib.nullcontext)


def test_local_loss_passes_plain_tensors_through():
    loss = local_loss(lambda a, b: (a * b).sum())(torch.ones(3), torch.full((3,), 2.0))
    assert type(loss) is torch.Tensor and loss.item() == 6.0


def test_sac_save_list_names_cpu_and_cuda_attention():
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in SAC_SAVE_OPS
    assert aten._scaled_dot_product_flash_attention.default in SAC_SAVE_OPS
    assert aten._scaled_dot_product_efficient_attention.default in SAC_SAVE_OPS
    assert aten._scaled_dot_product_cudnn_attention.default in SAC_SAVE_OPS
    assert aten.mm.default in SAC_SAVE_OPS


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_op_counts(mode, option="2"):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    apply_ac(model.layers, mode, option)
    loss = model(torch.randint(0, ARGS.vocab_size, (2, 8))).sum()
    with CountOps() as counter:
        loss.backward()
    return counter.counts


def test_what_each_ac_mode_recomputes_in_backward():
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    none, full, by_op = backward_op_counts("none"), backward_op_counts("full"), backward_op_counts("selective", "op")
    assert none.get(sdpa, 0) == 0
    assert full[sdpa] == ARGS.n_layers  # full AC reruns every block's forward, attention included
    assert by_op.get(sdpa, 0) == 0  # selective by op keeps attention's output...
    assert by_op[aten.mm.default] == none[aten.mm.default]  # ...and every matmul's
    assert by_op[aten.silu.default] == ARGS.n_layers  # but recomputes the cheap elementwise ops
    every_2nd = backward_op_counts("selective", "2")
    assert every_2nd[sdpa] == ARGS.n_layers // 2


def saved_activation_bytes_and_grads(budget):
    """Bytes the compiled blocks keep for backward under a memory budget, and the gradients they give."""
    import torch._dynamo

    torch._dynamo.reset()  # the budget is read when a block compiles
    torch.manual_seed(0)
    model = Transformer(ARGS)
    options = ParallelizeOptions(
        ac_mode="memory_budget", memory_budget=budget, compile_model=True, compile_backend="aot_eager_decomp_partition"
    )
    parallelize_llama(model, None, ParallelDims(1), options)
    saved = []

    def keep(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    tokens = torch.randint(0, ARGS.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(tokens).float().pow(2).mean()
    loss.backward()
    return sum(saved), [p.grad for p in model.parameters()]


def test_memory_budget_trades_kept_activations_for_recomputation_exactly():
    """A lower budget keeps fewer bytes for backward (the partitioner recomputes instead), with the same
    gradients: recomputation is exact."""
    import torch._functorch.config as functorch_config

    try:
        (low, low_grads), (high, high_grads) = (saved_activation_bytes_and_grads(b) for b in (0.0, 1.0))
    finally:
        functorch_config.activation_memory_budget = 1.0
        torch._dynamo.reset()
    assert low < 0.8 * high, (low, high)
    for got, want in zip(low_grads, high_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_every_nth_block_is_wrapped_counting_from_one():
    model = meta_model()
    apply_ac(model.layers, "selective", "2")
    wrapped = [name for name, block in model.layers.items() if type(block).__name__ == "CheckpointWrapper"]
    assert wrapped == ["1", "3"]
    assert {model_fqn(name) for name, _ in model.named_parameters()} == {n for n, _ in meta_model().named_parameters()}


def test_single_process_parallelize_needs_no_mesh_and_keeps_names():
    assert build_mesh(ParallelDims(1), "cpu") is None
    model = meta_model()
    parallelize_llama(model, None, ParallelDims(1), ParallelizeOptions(ac_mode="full"))
    assert all(type(block).__name__ == "CheckpointWrapper" for block in model.layers.values())
    assert set(model.state_dict()) == set(meta_model().state_dict())
    with pytest.raises(ParallelismError, match="needs a device mesh"):
        parallelize_llama(meta_model(), None, ParallelDims(2), ParallelizeOptions())


def test_init_like_single_device_matches_seeded_init_and_leaves_rng_alone():
    expected = meta_model().to_empty(device="cpu")
    torch.manual_seed(7)
    expected.init_weights()
    model = meta_model()
    reference = meta_model()
    apply_ac(model.layers, "full")
    model.to_empty(device="cpu")
    torch.manual_seed(123)
    state_before = torch.get_rng_state()
    init_weights_like_single_device(model, reference, seed=7)
    assert torch.equal(torch.get_rng_state(), state_before)
    got = {model_fqn(name): p for name, p in model.named_parameters()}
    for name, param in expected.named_parameters():
        assert torch.equal(got[name], param), name
    torch.testing.assert_close(model.rope_cache, expected.rope_cache, rtol=0, atol=0)


def test_init_keeps_tied_weights_tied():
    from dataclasses import replace

    tied = replace(ARGS, tie_word_embeddings=True)
    model, reference = meta_model(tied), meta_model(tied)
    model.to_empty(device="cpu")
    init_weights_like_single_device(model, reference, seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.abs().sum() > 0


def test_sharded_init_is_refused_on_cpu():
    model = meta_model().to_empty(device="cpu")
    with pytest.raises(ParallelismError, match="init_weights_like_single_device"):
        init_weights_sharded(model, seed=0)


def test_memory_footprint_of_a_single_process():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    optimizer = torch.optim.AdamW(model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    before = memory_footprint(model, optimizer)
    assert (before.param_bytes, before.grad_bytes, before.optimizer_bytes) == (4 * numel, 4 * numel, 0)
    model(torch.randint(0, ARGS.vocab_size, (1, 8))).sum().backward()
    optimizer.step()
    after = memory_footprint(model, optimizer)
    n_params = len(list(model.parameters()))
    assert after.optimizer_bytes == 2 * 4 * numel + 4 * n_params  # exp_avg, exp_avg_sq and a float32 step each
    assert after.total_bytes == after.param_bytes + after.grad_bytes + after.optimizer_bytes
    assert "MiB" in after.format()


def test_distributed_helpers_for_one_process():
    assert dp_rank_and_size(None) == (0, 1)
    value = torch.tensor(3.0)
    total = sum_over_dp(value, None)
    assert total.item() == 3.0 and total is not value
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "cuda:nccl,cpu:gloo"
