"""Pipeline parallel end to end: `NPROC=2 ./run_train.sh` with pp=2 trains the debug model like one process.

Three launches (each costs seconds of torchrun and imports): the 1-process reference, ZBVZeroBubble (two stages
per rank on the V placement, the default split) and Interleaved1F1B with an explicit split given on the command
line (`parallelism.module_fqns_per_model_part`) and 2-sequence microbatches. Same seed, same data, fp32: the
losses must agree to 1e-5 relative at every step, and the log must show the split and the bubble comparison.
"""

import pytest
from run_train_helpers import FP32, TINY, read_metrics, run_train

pytestmark = pytest.mark.slow

PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
PIPELINES = {
    "zbv": [*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
    "interleaved_explicit_split": [
        *PP2,
        "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
        "--parallelism.pipeline_parallel_microbatch_size", "2",
        "--parallelism.module_fqns_per_model_part",
        "tok_embeddings layers.0,layers.1 layers.2,layers.3 layers.4,layers.5 norm output",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (completed process, metrics records) for the 1-process reference and every pipeline."""
    folder = tmp_path_factory.mktemp("pipeline_e2e")
    results = {}
    for name, args, env in [("single", [], {}), *((name, args, {"NPROC": "2"}) for name, args in PIPELINES.items())]:
        result = run_train(*TINY, *FP32, *args, "--job.dump_folder", str(folder / name), **env)
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
        results[name] = (result, read_metrics(folder / name))
    return results


def relative_diffs(records: list[dict], reference: list[dict], key: str) -> list[float]:
    assert [r["step"] for r in records] == [r["step"] for r in reference] == list(range(1, 9))
    return [abs(r[key] - e[key]) / abs(e[key]) for r, e in zip(records, reference)]


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_reproduces_the_single_process_losses(runs, name):
    reference, records = runs["single"][1], runs[name][1]
    assert max(relative_diffs(records, reference, "loss")) <= 1e-5
    # Clipping uses the norm over all stages: the same as one process's.
    assert max(relative_diffs(records, reference, "grad_norm")) <= 1e-4
    assert [r["lr"] for r in records] == [r["lr"] for r in reference]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5


def test_log_shows_the_split_and_the_bubble(runs):
    zbv = runs["zbv"][0].stderr
    assert "2 processes (PP ZBVZeroBubble: pp 2" in zbv
    assert "pipeline: ZBVZeroBubble over 2 ranks, 4 stages (2 per rank, v placement), 4 microbatches of 1" in zbv
    assert "stage 0 on pp rank 0: tok_embeddings, layers.0" in zbv
    assert "stage 3 on pp rank 0: layers.5, norm, output" in zbv
    assert "pipeline bubble (idle share of a step; p=2, m=4, ideal timing)" in zbv
    assert "*ZBVZeroBubble (v=2) 4.0%" in zbv

    interleaved = runs["interleaved_explicit_split"][0].stderr
    assert "Interleaved1F1B over 2 ranks, 4 stages (2 per rank, loop placement), 2 microbatches of 2" in interleaved
    assert "stage 1 on pp rank 1: layers.1-2" in interleaved
    assert "stage 2 on pp rank 0: layers.3-4" in interleaved
    assert "*Interleaved1F1B (v=2) 20.0%" in interleaved
    assert "DualPipeV (v=2) n/a" in interleaved  # 2 microbatches are fewer than its 4 stages
