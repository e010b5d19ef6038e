"""ParallelDims: degrees resolved and validated against the world, the model and the batch, with no process group."""

from types import SimpleNamespace

import pytest

from dtrain.parallelize import ParallelDims, ParallelismError, get_family

MODEL = dict(n_heads=8, n_kv_heads=8, ffn_hidden_dim=256, vocab_size=256, seq_len=16)


def check_shapes(dims: ParallelDims, **model) -> None:
    """The Llama 3 family's shape checks on a model with MODEL's sizes (`model` overrides some)."""
    sizes = {**MODEL, **model}
    seq_len = sizes.pop("seq_len")
    get_family("llama3").check_shapes(dims, SimpleNamespace(**sizes, moe=None), seq_len)


def test_shard_degree_minus_one_takes_the_rest():
    dims = ParallelDims(8, dp_replicate=2, tp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 2)
    assert dims.dp_size == 4
    assert dims.fsdp_enabled and dims.hsdp_enabled and not dims.ddp_enabled
    assert dims.tp_enabled and dims.sequence_parallel_enabled and dims.loss_parallel_enabled


def test_which_data_parallelism_owns_the_parameters():
    assert ParallelDims(2).fsdp_enabled and not ParallelDims(2).hsdp_enabled
    ddp = ParallelDims(2, dp_replicate=2, dp_shard=1)
    assert ddp.ddp_enabled and not ddp.fsdp_enabled and ddp.dp_size == 2
    # Replicas of a TP model go through fully_shard (HSDP with shard degree 1): DDP does not compose with TP.
    replicas_of_tp = ParallelDims(4, dp_replicate=2, dp_shard=1, tp=2)
    assert replicas_of_tp.hsdp_enabled and not replicas_of_tp.ddp_enabled
    single = ParallelDims(1)
    assert single.dp_size == 1 and not (single.fsdp_enabled or single.ddp_enabled or single.tp_enabled)


def test_sequence_and_loss_parallel_need_tp():
    dims = ParallelDims(2, sequence_parallel=True, loss_parallel=True)
    assert not dims.sequence_parallel_enabled and not dims.loss_parallel_enabled
    assert not ParallelDims(2, dp_shard=1, tp=2, loss_parallel=False).loss_parallel_enabled


def test_degrees_that_do_not_multiply_to_the_world_size():
    with pytest.raises(ParallelismError) as error:
        ParallelDims(4, dp_replicate=2, dp_shard=2, tp=2)
    assert str(error.value) == (
        "parallelism.data_parallel_replicate_degree=2 × parallelism.data_parallel_shard_degree=2 × "
        "parallelism.tensor_parallel_degree=2 = 8 is not the world size 4; "
        "set parallelism.data_parallel_shard_degree=-1 to use what the other degrees leave"
    )


def test_rest_that_does_not_divide():
    with pytest.raises(ParallelismError) as error:
        ParallelDims(4, tp=3)
    assert str(error.value) == (
        "parallelism.tensor_parallel_degree=3 does not divide the world size 4, "
        "so parallelism.data_parallel_shard_degree=-1 cannot fill the rest"
    )


def test_expert_parallel_borrows_from_the_fsdp_ranks():
    dims = ParallelDims(8, dp_shard=4, cp=2, ep=4)
    assert dims.ep_enabled and dims.efsdp == 2 and dims.world_size == 8  # ep is not a factor of the world size
    with pytest.raises(ParallelismError, match=(
        r"^parallelism.expert_parallel_degree=3 does not divide parallelism.data_parallel_shard_degree × "
        r"parallelism.context_parallel_degree = 4, the ranks expert parallel borrows \(valid: 1, 2, 4\)$"
    )):
        ParallelDims(4, ep=3)
    # Replicas and TP ranks each hold their own copy of the expert-parallel split.
    assert ParallelDims(8, dp_replicate=2, dp_shard=2, tp=2, ep=2).efsdp == 1


def test_context_parallel_ranks_shard_parameters_with_fsdp():
    cp_only = ParallelDims(2, dp_shard=1, cp=2)
    assert cp_only.cp_enabled and cp_only.fsdp_enabled and cp_only.dp_size == 1
    hsdp_cp = ParallelDims(4, dp_replicate=2, dp_shard=1, cp=2)
    assert hsdp_cp.hsdp_enabled and not hsdp_cp.ddp_enabled
    assert ParallelDims(8, cp=2, tp=2).dp_shard == 2


@pytest.mark.parametrize(
    "seq_len, load_balancer, message",
    [
        (12, "headtail", "training.seq_len=12 is not a multiple of 2 × parallelism.context_parallel_degree = 8 "),
        (6, "none", "training.seq_len=6 is not a multiple of parallelism.context_parallel_degree = 4 "),
    ],
)
def test_context_parallel_needs_sequences_it_can_cut(seq_len, load_balancer, message):
    dims = ParallelDims(4, dp_shard=1, cp=4)
    with pytest.raises(ParallelismError) as error:
        dims.check_cp_divides(seq_len, load_balancer)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    dims.check_cp_divides(16, load_balancer)


def test_torchs_ring_needs_head_tail_chunks_of_32_rows():
    """torch's ring merges half-chunk log-sum-exps that the memory-efficient kernel pads to 32 rows: seq_len 64
    over cp=2 (chunks of 16) crashed on an H100; the check refuses it in one line, and the CPU paths take it."""
    dims = ParallelDims(2, dp_shard=1, cp=2)
    with pytest.raises(ParallelismError) as error:
        dims.check_cp_divides(64, "headtail", torch_ring=True)
    message = str(error.value)
    assert message.startswith("training.seq_len=64 gives head-tail chunks of 16 rows")
    assert "valid seq_len: 128, 256" in message
    dims.check_cp_divides(128, "headtail", torch_ring=True)
    dims.check_cp_divides(64, "headtail")
    dims.check_cp_divides(64, "none", torch_ring=True)


@pytest.mark.parametrize("degrees", [dict(tp=0), dict(dp_shard=0), dict(dp_shard=-2), dict(dp_replicate=-1)])
def test_nonpositive_degrees(degrees):
    with pytest.raises(ParallelismError, match="is invalid"):
        ParallelDims(2, **degrees)


def test_parallelism_error_is_a_value_error():
    assert issubclass(ParallelismError, ValueError)


def test_tp_must_divide_the_heads():
    dims = ParallelDims(3, dp_shard=1, tp=3)
    with pytest.raises(ParallelismError) as error:
        check_shapes(dims)
    assert str(error.value) == "parallelism.tensor_parallel_degree=3 does not divide model.n_heads=8 (valid: 1, 2, 4, 8)"


@pytest.mark.parametrize(
    "override, named",
    [
        (dict(n_kv_heads=2), "model.n_kv_heads=2"),
        (dict(ffn_hidden_dim=250), "FFN hidden size=250"),
        (dict(vocab_size=258), "vocab size=258"),
        (dict(seq_len=10), "training.seq_len=10"),
    ],
)
def test_tp_must_divide_kv_heads_ffn_vocab_and_sequence(override, named):
    with pytest.raises(ParallelismError, match=named):
        check_shapes(ParallelDims(4, dp_shard=1, tp=4), **override)


def test_sequence_length_only_matters_under_sequence_parallel():
    check_shapes(ParallelDims(4, dp_shard=1, tp=4, sequence_parallel=False), seq_len=10)
    check_shapes(ParallelDims(4), n_heads=3)  # no TP: nothing to divide


def test_vocab_message_suggests_the_rounding_knob():
    with pytest.raises(ParallelismError, match="model.vocab_size_multiple_of"):
        check_shapes(ParallelDims(2, dp_shard=1, tp=2), vocab_size=255)


def test_gradient_accumulation_steps():
    dims = ParallelDims(4, dp_replicate=2)
    assert dims.gradient_accumulation_steps(local_batch_size=2, global_batch_size=16) == 2
    assert dims.gradient_accumulation_steps(local_batch_size=2, global_batch_size=-1) == 1
    with pytest.raises(ParallelismError) as error:
        dims.gradient_accumulation_steps(local_batch_size=2, global_batch_size=12)
    assert str(error.value) == (
        "training.global_batch_size=12 is not a multiple of training.local_batch_size=2 × data-parallel size 4 = 8 "
        "(valid: -1, 8, 16, 24, ...)"
    )


def test_tp_ranks_share_a_batch():
    # TP ranks see the same data: only data-parallel ranks split the global batch.
    assert ParallelDims(4, dp_shard=2, tp=2).gradient_accumulation_steps(local_batch_size=2, global_batch_size=8) == 2
