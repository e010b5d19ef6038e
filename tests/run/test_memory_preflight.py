"""The pre-flight memory check: the estimate against what a step really holds, FSDP's sharding, and the refusal
(before anything is written or allocated) with its override, training.skip_memory_check.

Measurements use torch's MemTracker, a dispatch mode that follows every tensor storage as it is created and
freed, so they are exact and deterministic (the process's RSS would add the allocator's and Python's own).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from dtrain.config import load_config
from dtrain.config.schema import Optimizer
from dtrain.parallelize import ParallelDims, ParallelizeOptions, apply_ac, build_mesh, get_family, memory_footprint
from dtrain.run import memory_preflight
from dtrain.run.layout import ParallelLayout
from dtrain.run.memory_preflight import InsufficientMemory, Workload, activation_bytes, estimate_memory
from dtrain.run.prepare import prepare
from dtrain.run.train import train
from dtrain.step.optimizer import build_optimizer
from dtrain.step.train_step import cross_entropy_sum

LLAMA3, QWEN3 = get_family("llama3"), get_family("qwen3")
BATCH, SEQ = 4, 128
ARGS = dataclasses.replace(LLAMA3.model.flavors["debugmodel"], n_layers=2, max_seq_len=SEQ)
# QK-norm, and head_dim * n_heads (2048) far above dim (256).
QWEN3_ARGS = dataclasses.replace(QWEN3.model.flavors["debugmodel"], n_layers=2, max_seq_len=SEQ)
SINGLE = ParallelLayout(ParallelDims(1), ParallelizeOptions())
WORKLOAD = Workload(BATCH, -1, SEQ, microbatches=1, optimizer="AdamW", foreach_step=True, skip=False)
MIB = 1024**2


def meta_parts(layout: ParallelLayout, family=LLAMA3, args=ARGS) -> list[torch.nn.Module]:
    """The model as model_builder has it when the check runs: parallelized, still on the meta device."""
    with torch.device("meta"):
        model = family.model.model_cls(args)
    return [family.parallelize(model, layout.mesh, layout.dims, layout.options)]


def real_model(ac_mode="none", selective="2", dtype=torch.float32, family=LLAMA3, args=ARGS):
    """The model on the CPU, checkpointed as `ac_mode` says, with its AdamW."""
    torch.manual_seed(0)
    model = family.model.model_cls(args).to(dtype)
    apply_ac(model.layers, ac_mode, selective)
    return model, build_optimizer([model], Optimizer(), torch.device("cpu"))


def batch():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, ARGS.vocab_size, (BATCH, SEQ), generator=generator) for _ in range(2)]


# Document masking's document ids: four documents per sequence.
DOCUMENT_IDS = torch.arange(SEQ).div(SEQ // 4, rounding_mode="floor").expand(BATCH, SEQ)


def peak(model, optimizer, with_step: bool, document_ids: torch.Tensor | None = None) -> dict:
    """The live tensor bytes at the peak of a training step (forward and backward, and the optimizer step when
    `with_step`) by MemTracker's kind (param, grad, act, temp, opt, ... and total), after a first step that
    creates the optimizer state."""
    tokens, labels = batch()

    def step(with_step: bool) -> None:
        cross_entropy_sum(model(tokens, document_ids=document_ids), labels).backward()
        if with_step:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step(with_step=True)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step(with_step)
    (snapshot,) = tracker.get_tracker_snapshot("peak").values()
    return {str(kind).split(".")[-1].lower(): value for kind, value in snapshot.items()}


def test_params_grads_and_optimizer_are_exactly_what_a_step_leaves():
    estimate = estimate_memory(meta_parts(SINGLE), ARGS, SINGLE, WORKLOAD, torch.device("cpu"))
    model, optimizer = real_model()
    tokens, labels = batch()
    cross_entropy_sum(model(tokens), labels).backward()
    optimizer.step()  # Adam creates its moments (and step counts) here
    actual = memory_footprint(model, optimizer)
    assert (estimate.params, estimate.grads, estimate.optimizer) == (
        actual.param_bytes, actual.grad_bytes, actual.optimizer_bytes
    )
    assert estimate.optimizer_step == actual.param_bytes  # foreach Adam's one parameter-sized temporary list


@pytest.mark.parametrize(
    "family, args, dtype",
    [(LLAMA3, ARGS, torch.float32), (LLAMA3, ARGS, torch.bfloat16), (QWEN3, QWEN3_ARGS, torch.float32)],
    ids=["llama3-fp32", "llama3-bf16", "qwen3-fp32"],
)
def test_activations_match_the_measured_backward_peak(family, args, dtype):
    # Without AC the peak of forward and backward is that of the activations (early in backward, when few
    # gradients exist). FSDP's mixed precision computes in bf16: a bf16 model in one process holds the same.
    layout = SINGLE
    if dtype == torch.bfloat16:
        layout = ParallelLayout(ParallelDims(2, dp_shard=2), ParallelizeOptions(param_dtype="bfloat16"))
    measured = peak(*real_model(dtype=dtype, family=family, args=args), with_step=False)
    activations = measured["act"] + measured["temp"]
    estimated = activation_bytes(meta_parts(SINGLE, family, args), args, layout, BATCH, SEQ)
    assert estimated == pytest.approx(activations, rel=0.03), (estimated / MIB, activations / MIB)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_document_masking_adds_the_measured_mask_per_layer(dtype):
    # The mask is a few percent of the activations here, within the tolerance above: compare what it adds.
    options = dict(param_dtype="bfloat16") if dtype == torch.bfloat16 else {}
    dims = ParallelDims(2, dp_shard=2) if dtype == torch.bfloat16 else ParallelDims(1)
    estimated, measured = [], []
    for mask, document_ids in (("causal", None), ("block_causal", DOCUMENT_IDS)):
        layout = ParallelLayout(dims, ParallelizeOptions(attention_mask=mask, **options))
        estimated.append(activation_bytes(meta_parts(SINGLE), ARGS, layout, BATCH, SEQ))
        kinds = peak(*real_model(dtype=dtype), with_step=False, document_ids=document_ids)
        measured.append(kinds["act"] + kinds["temp"])
    mask_bytes = ARGS.n_layers * BATCH * SEQ * SEQ * dtype.itemsize
    assert estimated[1] - estimated[0] == mask_bytes
    assert measured[1] - measured[0] == pytest.approx(mask_bytes, rel=0.05), (measured[1] - measured[0]) / MIB


def test_a_memory_budget_is_counted_between_full_ac_and_none():
    """Budget 1 keeps what compile keeps without AC; less keeps less, down to full AC's inputs at 0."""
    def estimate(**options):
        layout = ParallelLayout(ParallelDims(1), ParallelizeOptions(**options))
        return activation_bytes(meta_parts(SINGLE), ARGS, layout, BATCH, SEQ)

    budget = [estimate(ac_mode="memory_budget", memory_budget=m) for m in (0.0, 0.5, 1.0)]
    assert budget[0] < budget[1] < budget[2] == estimate(ac_mode="none")
    assert budget[0] <= estimate(ac_mode="full")


@pytest.mark.parametrize("ac_mode, selective", [("none", "2"), ("full", "2"), ("selective", "2"), ("selective", "op")])
def test_the_estimate_covers_the_measured_peak_of_a_step_by_at_most_30_percent(ac_mode, selective):
    layout = ParallelLayout(ParallelDims(1), ParallelizeOptions(ac_mode=ac_mode, selective_ac_option=selective))
    measured = peak(*real_model(ac_mode, selective), with_step=True)["total"]
    estimate = estimate_memory(meta_parts(layout), ARGS, layout, WORKLOAD, torch.device("cpu"))
    estimated = estimate.total - estimate.batches  # the tracker sees the tokens, made before it, as inputs
    assert measured <= estimated <= 1.3 * measured, (estimated / MIB, measured / MIB)


@pytest.fixture
def fake_world_of_4():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_fsdp_divides_the_states_by_the_shard_degree_and_gathers_two_blocks(fake_world_of_4):
    whole = estimate_memory(meta_parts(SINGLE), ARGS, SINGLE, WORKLOAD, torch.device("cpu"))
    dims = ParallelDims(4)
    fsdp = ParallelLayout(dims, ParallelizeOptions(param_dtype="bfloat16"), mesh=build_mesh(dims, "cpu"))
    sharded = estimate_memory(meta_parts(fsdp), ARGS, fsdp, WORKLOAD, torch.device("cpu"))
    assert (sharded.params, sharded.grads) == (whole.params // 4, whole.grads // 4)
    assert sharded.optimizer == 2 * sharded.params + 4 * sum(1 for _ in meta_parts(SINGLE)[0].parameters())
    block = sum(p.numel() for p in meta_parts(SINGLE)[0].layers["0"].parameters())
    assert sharded.gathered == 2 * block * 2  # two whole blocks in bf16
    assert sharded.activations < whole.activations  # computed in bf16


def tiny_config(tmp_path, *extra: str):
    return load_config([
        "--training.steps", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--job.dump_folder", str(tmp_path / "run"), *extra,
    ])


def test_a_refused_run_writes_nothing_and_skip_memory_check_lets_it_train(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_preflight, "device_memory_bytes", lambda device: MIB)
    cfg = tiny_config(tmp_path)
    with pytest.raises(InsufficientMemory) as refusal:
        train(cfg, prepare(cfg))
    message = str(refusal.value)
    assert message.startswith("estimated memory per rank ") and "exceeds cpu's 0.00 GiB" in message
    assert all(term in message for term in ("params", "grads", "optimizer", "--training.skip_memory_check"))
    assert "\n" not in message
    assert not (tmp_path / "run").exists()  # no config.toml, no metrics, no lock, not even the folder

    cfg = tiny_config(tmp_path, "--training.skip_memory_check")
    train(cfg, prepare(cfg))
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


def test_a_step_whose_microbatches_exceed_host_memory_is_refused(tmp_path, monkeypatch):
    # 8 sequences per step in microbatches of 2: 4 microbatches of 2 x 32 int64 ids and labels, 4 KiB.
    monkeypatch.setattr(memory_preflight, "host_memory_bytes", lambda: 4095)
    cfg = tiny_config(tmp_path, "--training.global_batch_size", "8")
    with pytest.raises(InsufficientMemory, match=(
        r"^training.global_batch_size=8 takes 4 microbatches of training.local_batch_size=2 x training.seq_len=32 "
        r"per step on this rank, held at once: 0.00 GiB, more than .*--training.skip_memory_check$"
    )):
        train(cfg, prepare(cfg))
    assert not (tmp_path / "run").exists()
