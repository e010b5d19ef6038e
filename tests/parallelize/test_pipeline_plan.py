"""Pipeline planning, model splitting and bubble formulas: single-process checks, no process group."""

from __future__ import annotations

import pytest
import torch

from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.parallelize import ParallelismError
from dtrain.parallelize.pipeline_bubble import bubble_fraction, format_bubbles
from dtrain.parallelize.pipeline_plan import PIPELINE_SCHEDULES, compact_names, even_split, plan_pipeline
from dtrain.parallelize.pipeline_split import split_model

DECODER = Transformer.decoder_layout
ARGS = Llama3Args(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, ffn_dim_multiplier=None, max_seq_len=8
)


def plan(**overrides):
    kwargs = dict(pp=2, schedule="1F1B", decoder=DECODER, n_layers=4, local_batch_size=8, microbatch_size=2)
    kwargs.update(overrides)
    return plan_pipeline(**kwargs)


def test_default_split_counts_embedding_and_head_as_layers():
    assert plan().stage_modules == (
        ("tok_embeddings", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm", "output"),
    )
    # 6 units over 4 stages: the first two stages take the remainder.
    assert even_split(DECODER, 4, 4) == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3"], ["norm", "output"]]


@pytest.mark.parametrize(
    "schedule, stages_rank0, stages_rank1",
    [
        ("gpipe", (0,), (1,)),
        ("1f1b", (0,), (1,)),
        ("interleaved1f1b", (0, 2), (1, 3)),
        ("LOOPEDBFS", (0, 2), (1, 3)),
        ("InterleavedZeroBubble", (0, 2), (1, 3)),
        ("zbvzerobubble", (0, 3), (1, 2)),
        ("DualPipeV", (0, 3), (1, 2)),
    ],
)
def test_placement_per_schedule(schedule, stages_rank0, stages_rank1):
    result = plan(schedule=schedule, microbatch_size=1)
    assert result.schedule in PIPELINE_SCHEDULES  # canonical spelling, whatever the case given
    assert result.stage_indices(0) == stages_rank0
    assert result.stage_indices(1) == stages_rank1
    assert [result.rank_of_stage(s) for s in stages_rank0] == [0] * len(stages_rank0)


def test_layers_per_stage_sets_the_number_of_stages():
    result = plan(schedule="Interleaved1F1B", layers_per_stage=1)
    assert result.num_stages == 6 and result.stages_per_rank == 3
    assert result.stage_indices(1) == (1, 3, 5)
    assert plan(layers_per_stage=3).num_stages == 2


def test_explicit_modules_as_strings_or_lists():
    as_strings = plan(stage_modules=["tok_embeddings layers.0", "layers.1 layers.2 layers.3 norm output"])
    as_lists = plan(stage_modules=[["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "norm", "output"]])
    assert as_strings.stage_modules == as_lists.stage_modules
    assert as_strings.stage_modules[0] == ("tok_embeddings", "layers.0")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pp=1), "pipeline_parallel_degree=1"),
        (dict(schedule="Zero"), "pipeline_parallel_schedule='Zero' is invalid (valid: GPipe, 1F1B"),
        (dict(layers_per_stage=1), "1F1B runs one stage per rank"),
        (dict(schedule="Interleaved1F1B", layers_per_stage=3), "interleaves several stages per rank"),
        (dict(schedule="ZBVZeroBubble", layers_per_stage=1), "needs exactly 2 stages per rank"),
        (dict(layers_per_stage=2), "cuts 4 layers + embedding + head into 3 stages, not a multiple of"),
        (dict(schedule="Interleaved1F1B", layers_per_stage=2), "3 stages, not a multiple of"),
        (dict(pp=4, schedule="Interleaved1F1B"), "only 6 units to split"),
        (dict(local_batch_size=1, microbatch_size=1), "1F1B needs at least as many microbatches as stages (2)"),
        (dict(schedule="DualPipeV", local_batch_size=2, microbatch_size=1), "DualPipeV needs at least as many"),
        (dict(schedule="Interleaved1F1B", local_batch_size=5, microbatch_size=1), "do not fill 2 rounds"),
        (dict(local_batch_size=6, microbatch_size=4), "local_batch_size=6 is not a multiple of"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings=true shares one weight"),
        (dict(schedule="ZBVZeroBubble", fsdp_reshard_after_forward="always"), "fsdp_reshard_after_forward=always"),
        (dict(ddp=True), "cannot be combined with DDP (parallelism.data_parallel_replicate_degree > 1 alone)"),
        (dict(stage_modules=["tok_embeddings layers.0"], layers_per_stage=2), "not both"),
        (dict(stage_modules=["tok_embeddings layers.0 layers.1", ""]), "stage 1 holds no module"),
        (dict(stage_modules=["tok_embeddings layers.0 layers.1", "layers.2 layer.3 norm output"]), "unknown module"),
        (dict(stage_modules=["tok_embeddings layers.0 layers.1", "layers.2 layers.3 norm output output"]), "more than"),
        (dict(stage_modules=["tok_embeddings layers.0", "layers.2 layers.3 norm output"]), "no stage holds layers.1"),
        (dict(stage_modules=["tok_embeddings layers.1 layers.0", "layers.2 layers.3 norm output"]), "'layers.1' comes"),
        (dict(stage_modules=["tok_embeddings", "layers.0", "layers.1 layers.2 layers.3 norm output"]), "3 stages"),
    ],
)
def test_invalid_layouts_fail_with_one_line_naming_the_key(overrides, message):
    with pytest.raises(ParallelismError) as error:
        plan(**overrides)
    text = str(error.value)
    assert message in text
    assert "\n" not in text
    assert "parallelism." in text or "training." in text or "model." in text


def test_describe_lists_every_stage_with_its_rank():
    text = plan(schedule="ZBVZeroBubble", microbatch_size=1).describe()
    assert "ZBVZeroBubble over 2 ranks, 4 stages (2 per rank, v placement), 8 microbatches of 1 sequences" in text
    assert "stage 3 on pp rank 0: norm, output" in text
    assert compact_names(["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.5", "norm"], DECODER) == (
        "tok_embeddings, layers.0-2, layers.5, norm"
    )


def test_bubble_formulas():
    # p = 4 ranks, m = 8 microbatches, v = 2 stages per rank.
    assert bubble_fraction("GPipe", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("1F1B", 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("InterleavedZeroBubble", 4, 8, 2) == pytest.approx(3 / 51)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == pytest.approx(3 / 51)
    assert bubble_fraction("DualPipeV", 4, 4, 2) == pytest.approx(1 / 9)
    # One microbatch cannot be pipelined: the whole chain runs with every other rank idle.
    assert bubble_fraction("Interleaved1F1B", 2, 1, 2) == pytest.approx(1 / 2)
    assert bubble_fraction("ZBVZeroBubble", 2, 1, 2) == pytest.approx(1 / 3)
    # More microbatches always shrink the bubble.
    assert bubble_fraction("1F1B", 4, 16, 1) < bubble_fraction("1F1B", 4, 8, 1)


def test_bubble_line_marks_the_configured_schedule_and_impossible_ones():
    line = format_bubbles(plan(pp=2, schedule="GPipe", local_batch_size=1, microbatch_size=1))
    assert "*GPipe 50.0%" in line
    assert "1F1B n/a" in line  # one microbatch is fewer than 1F1B's two stages
    assert "Interleaved1F1B (v=2) 50.0%" in line
    assert "ZBVZeroBubble (v=2) 33.3%" in line
    assert line.count("%") + line.count("n/a") == len(PIPELINE_SCHEDULES)


def test_stages_chain_to_the_full_model_and_keep_full_names():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    layout = plan(schedule="Interleaved1F1B", layers_per_stage=1)
    stages = split_model(model, layout, 0) + split_model(model, layout, 1)
    stages.sort(key=lambda stage: stage.index)
    assert [s.index for s in stages] == list(range(6))
    names = [name for stage in stages for name in stage.module.state_dict()]
    assert sorted(names) == sorted(model.state_dict())
    assert stages[0].module.norm is None and stages[0].module.output is None
    assert stages[-1].module.tok_embeddings is None and len(stages[-1].module.layers) == 0
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    hidden = tokens
    for stage in stages:
        hidden = stage.module(hidden)
    torch.testing.assert_close(hidden, model(tokens), rtol=0, atol=0)
    assert len(model.layers) == 4 and model.output is not None  # the model itself is left whole


def test_split_on_meta_costs_nothing_and_checks_the_layer_count():
    with torch.device("meta"):
        model = Transformer(ARGS)
    stages = split_model(model, plan(), 1)
    assert all(p.is_meta for p in stages[0].module.parameters())
    with pytest.raises(ParallelismError, match="plan covers 6 layers but the model has 4"):
        split_model(model, plan(n_layers=6), 0)
