"""Through ./run_train.sh with several processes: a checkpoint saved under one layout resumes under another
(world size, FSDP2/TP/PP/CP degrees), and the losses continue within 1e-5 of the run that never stopped. Llama 3's
debug model in every layout; Qwen3's once (the in-process worlds of test_checkpoint_reshard.py cover both)."""

from __future__ import annotations

import shutil

import pytest
from e2e_checkpoint_helpers import CHECKPOINTED, read_metrics, resumed_step, run_train

from dtrain.config.toml_io import tomllib

# The CLI walkthrough of resharding: CI runs it under the default torch only; what torch's version can change (DCP
# resharding itself) is test_checkpoint_reshard.py's in-process worlds, which run under both (tests/torch_runs.py).
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.torch_independent]

GLOBAL_BATCH = 4
SAVED = 4
LAYOUTS = {
    "fsdp2": ("2", {"data_parallel_shard_degree": 2}),
    "fsdp2x2_tp2": ("4", {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}),
    "fsdp2x4": ("4", {"data_parallel_shard_degree": 4}),
    "tp2": ("2", {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2}),
    # Two ranks in a V: four stages, and the 4 sequences of a step are its 4 pipeline microbatches.
    "pp2_zbv": ("2", {"data_parallel_shard_degree": 1, "pipeline_parallel_degree": 2,
                      "pipeline_parallel_schedule": "ZBVZeroBubble"}),
    "cp2": ("2", {"data_parallel_shard_degree": 1, "context_parallel_degree": 2}),
    "single": ("1", {}),
}
# Qwen3's debug flavor (tied head, QK-norm), shrunk.
QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--model.args.n_layers", "2",
         "--model.args.hidden_dim", "256"]


def train_layout(name: str, run_dir, model: tuple[str, ...] = (), timeout: int = 600):
    """TINY training with checkpoints under the layout `name`, same global batch (so the same losses) in every one;
    `model` flags choose another model than the default."""
    nproc, degrees = LAYOUTS[name]
    dp = degrees.get("data_parallel_shard_degree", 1)
    # float32 compute under FSDP too (its default gathers parameters in bfloat16), for a 1e-5 comparison.
    args = [*CHECKPOINTED, *model, "--training.mixed_precision_param", "float32", "--job.dump_folder", str(run_dir),
            "--training.global_batch_size", str(GLOBAL_BATCH), "--training.local_batch_size", str(GLOBAL_BATCH // dp)]
    for key, value in degrees.items():
        args += [f"--parallelism.{key}", str(value)]
    result = run_train(*args, timeout=timeout, NPROC=nproc)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout + result.stderr


def resume_under(name: str, saved_run, tmp_path, reshards: bool = True, model: tuple[str, ...] = ()
                 ) -> dict[int, float]:
    """Copy step-SAVED of `saved_run` into a fresh run directory and rerun there under layout `name` (rule 1)."""
    run_dir = tmp_path / f"resumed_{name}"
    shutil.copytree(saved_run / "checkpoint" / f"step-{SAVED}", run_dir / "checkpoint" / f"step-{SAVED}")
    log = train_layout(name, run_dir, model)
    assert resumed_step(log) == SAVED and ("DCP reshards" in log) == reshards
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def assert_continues(resumed: dict[int, float], uninterrupted: dict[int, float]) -> None:
    assert sorted(resumed) == list(range(SAVED + 1, 9))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), step


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp2")
    train_layout("fsdp2", run_dir)
    return run_dir, {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def test_fsdp2_checkpoint_resumes_in_one_process(fsdp2_run, tmp_path):
    run_dir, losses = fsdp2_run
    assert_continues(resume_under("single", run_dir, tmp_path), losses)


def test_fsdp2_checkpoint_resumes_under_tp(fsdp2_run, tmp_path):
    run_dir, losses = fsdp2_run
    assert_continues(resume_under("tp2", run_dir, tmp_path), losses)


def test_context_parallel_checkpoints_do_not_depend_on_cp(fsdp2_run, tmp_path):
    """Saved at cp=2, resumed in one process; saved under FSDP2, resumed at cp=2: the losses continue."""
    run_dir = tmp_path / "cp2"
    train_layout("cp2", run_dir)
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    assert losses == pytest.approx(fsdp2_run[1], rel=1e-5)  # cp=2 trains as FSDP2 does on the same batches
    assert_continues(resume_under("single", run_dir, tmp_path), losses)
    assert_continues(resume_under("cp2", fsdp2_run[0], tmp_path), fsdp2_run[1])


def test_fsdp2_tp_checkpoint_resumes_under_fsdp2_over_four_ranks(tmp_path):
    run_dir = tmp_path / "fsdp2x2_tp2"
    train_layout("fsdp2x2_tp2", run_dir)
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    assert_continues(resume_under("fsdp2x4", run_dir, tmp_path), losses)


def test_pipeline_checkpoint_resumes_under_pipeline_and_under_fsdp2(tmp_path):
    run_dir = tmp_path / "pp2_zbv"
    train_layout("pp2_zbv", run_dir)
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    assert_continues(resume_under("pp2_zbv", run_dir, tmp_path, reshards=False), losses)
    assert_continues(resume_under("fsdp2", run_dir, tmp_path), losses)


def test_qwen3_fsdp2_checkpoint_resumes_in_one_process(tmp_path):
    run_dir = tmp_path / "qwen3_fsdp2"
    train_layout("fsdp2", run_dir, QWEN3)
    model = tomllib.loads((run_dir / "config.toml").read_text())["model"]
    assert (model["name"], model["args"]["n_layers"], model["args"]["tie_word_embeddings"]) == ("qwen3", 2, True)
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir)}
    assert_continues(resume_under("single", run_dir, tmp_path, model=QWEN3), losses)
