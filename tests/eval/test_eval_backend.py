"""dtrain's lm-evaluation-harness backend against the harness's own `hf` backend, on one tiny Llama that
transformers built with random weights: the same per-request log-likelihoods (fp32, 1e-5 relative), the same
greedy generations and the same task metrics (multiple choice, rolling perplexity, generation; 0 and 2 shots); then
the same answers from the model sharded by FSDP2 over a 2-process gloo world, each rank answering its share."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import run_world
from eval_helpers import hf_backend, write_tiny_llama

RTOL = 1e-5
BATCH = 3  # smaller than the request lists: several batches, one of them partial
CONTEXTS = [
    ("Question: The sky is", " blue"), ("Question: The sky is", " green"), ("Q: 2+3=", " 5"), ("", "hello world"),
    ("The quick brown fox jumps over", " the lazy dog. Once upon a time"), ("A", "B"), ("Q: 1+1=\nA:", " 2"),
]
ROLLING = ["The quick brown fox jumps over the lazy dog. " * 8, "Q: 2+3=\nA: 5"]  # the first needs 3 windows
PROMPTS = ["Q: 2+3=\nA:", "Q: 1+1=\nA:", "The quick", "Once upon a time", "Q: 4+5=\nA:"]


def requests():
    from lm_eval.api.instance import Instance

    greedy = {"until": ["\n"], "max_gen_toks": 10, "do_sample": False}
    return {
        "loglikelihood": [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(CONTEXTS)],
        "loglikelihood_rolling": [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(ROLLING)],
        "generate_until": [Instance("generate_until", {}, (p, greedy), i) for i, p in enumerate(PROMPTS)],
    }


def answers(lm) -> dict:
    return {kind: getattr(lm, kind)(reqs) for kind, reqs in requests().items()}


def task_results(lm, shots: int) -> dict:
    from dtrain.eval.evaluate import Evaluation, evaluate, task_metrics
    from dtrain.eval.tasks import resolve_tasks

    results, _ = evaluate(lm, Evaluation(resolve_tasks(["dtrain_tiny"], []), num_fewshot=shots))
    return task_metrics(results)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def harness(folder) -> dict:
    """The hf backend's answers and metrics: the reference of every comparison."""
    lm = hf_backend(folder, BATCH)
    return {"answers": answers(lm), **{shots: task_results(lm, shots) for shots in (0, 2)}}


def assert_same_answers(ours: dict, theirs: dict) -> dict:
    """The comparison; returns the largest differences (for the issue's closing note)."""
    worst = {"abs": 0.0, "rel": 0.0}
    for kind in ("loglikelihood", "loglikelihood_rolling"):
        for mine, reference in zip(ours[kind], theirs[kind], strict=True):
            mine, reference = (mine[0], reference[0]) if isinstance(mine, tuple) else (mine, reference)
            assert mine == pytest.approx(reference, rel=RTOL), kind
            worst["abs"] = max(worst["abs"], abs(mine - reference))
            worst["rel"] = max(worst["rel"], abs(mine - reference) / abs(reference))
    assert [greedy for _, greedy in ours["loglikelihood"]] == [greedy for _, greedy in theirs["loglikelihood"]]
    assert ours["generate_until"] == theirs["generate_until"]
    return worst


def test_one_process_equals_the_hf_backend(folder, harness):
    from dtrain.eval.loading import load_for_eval

    lm = load_for_eval(str(folder), hf=True, config_argv=[], batch_size=BATCH)
    worst = assert_same_answers(answers(lm), harness["answers"])
    print(f"largest log-likelihood difference: {worst['abs']:.3g} absolute, {worst['rel']:.3g} relative")
    for shots in (0, 2):
        assert task_results(lm, shots) == pytest.approx(harness[shots], rel=RTOL)
    assert {"eval/dtrain_tiny_choice/acc", "eval/dtrain_tiny_text/word_perplexity",
            "eval/dtrain_tiny_arithmetic/exact_match_strip"} <= set(harness[0])


def sharded_answers(rank: int, world_size: int, folder: str) -> dict:
    """What every rank answers with the model sharded by FSDP2 over the world (each rank holds half of each
    weight and answers half of the requests): rank 0's answers, and whether all ranks got the same."""
    import torch
    import torch.distributed as dist

    from dtrain.checkpoint.hf_io import load_hf_weights
    from dtrain.config.schema import Checkpoint, Model
    from dtrain.data import build_tokenizer
    from dtrain.eval.backend import DtrainLM
    from dtrain.parallelize import ParallelDims, ParallelizeOptions, build_mesh
    from dtrain.run.hf_start import hf_start

    start = hf_start(Checkpoint(initial_load_path=folder, initial_load_in_hf=True), Model().name)
    family, args = start.family, start.args
    dims = ParallelDims(world_size, dp_shard=world_size)
    with torch.device("meta"):
        model = family.model.model_cls(args)
    family.parallelize(model, build_mesh(dims, "cpu"), dims, ParallelizeOptions())
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    load_hf_weights([model], Path(folder), family.model.hf_adapter(args))
    tokenizer = build_tokenizer(Model(hf_assets_path=folder))
    lm = DtrainLM(model.eval(), tokenizer, args.max_seq_len, torch.device("cpu"), eos_ids=(1,), batch_size=BATCH)
    mine = {**answers(lm), "metrics": task_results(lm, 0)}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return {"answers": mine, "same_on_every_rank": all(other == mine for other in everyone)}


@pytest.mark.multiprocess
def test_fsdp_over_two_processes_equals_the_hf_backend(folder, harness):
    result = run_world(2, sharded_answers, str(folder))
    assert result["same_on_every_rank"]
    assert_same_answers(result["answers"], harness["answers"])
    assert result["answers"]["metrics"] == pytest.approx(harness[0], rel=RTOL)
