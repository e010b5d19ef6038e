"""A Qwen3-MoE flavor with its auxiliary loss through `./run_train.sh`: expert parallel, tensor parallel and pipeline
parallel over 2 processes reproduce the 1-process loss and auxiliary loss curves, and the MoE load statistics and
the auxiliary loss reach the console and metrics.jsonl."""

import pytest
from run_train_helpers import FP32, TINY, read_metrics, run_train

pytestmark = pytest.mark.slow

# dtrain's small debug MoE flavor shrunk, with an auxiliary loss (and untied embeddings, which pipeline stages need).
# Its statistics span the data-parallel microbatch: each layout below runs one microbatch of the 4 sequences per
# step, as the single process does.
MOE = [
    "--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small", "--model.args.n_layers", "2",
    "--model.args.dim", "64", "--model.args.moe_hidden_dim", "64", "--model.args.moe_aux_loss_coeff", "0.01",
    "--model.args.moe_load_balance_bias", "false", "--model.args.tie_word_embeddings", "false",
]
SAME_GLOBAL_BATCH = [*TINY, "--training.steps", "4", "--training.global_batch_size", "4", *FP32, *MOE]


@pytest.fixture(scope="module")
def single_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe") / "single"
    single = run_train(*SAME_GLOBAL_BATCH, "--job.dump_folder", str(folder))
    assert single.returncode == 0, single.stderr[-3000:]
    return folder


def test_expert_parallel_over_two_processes_matches_one(tmp_path, single_dir):
    ep_dir = tmp_path / "ep2"
    ep = run_train(*SAME_GLOBAL_BATCH, "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2",
                   "--job.dump_folder", str(ep_dir), NPROC="2")
    assert ep.returncode == 0, ep.stderr[-3000:]
    log = ep.stdout + ep.stderr
    assert "2 processes (FSDP + EP" in log and "experts over ep 2 × efsdp 1" in log
    assert "moe_imbalance" in log and "aux_loss" in log
    records, single = read_metrics(ep_dir), read_metrics(single_dir)
    for name in ("loss", "aux_loss"):
        assert [r[name] for r in records] == pytest.approx([r[name] for r in single], rel=1e-5)
    assert all(r["moe/load_imbalance_max"] >= 1.0 for r in records)
    assert {"moe/layers.0/load_imbalance", "moe/layers.1/load_imbalance"} <= set(records[-1])


def test_tensor_parallel_over_two_processes_matches_one(tmp_path, single_dir):
    tp = run_train(*SAME_GLOBAL_BATCH, "--parallelism.tensor_parallel_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "1", "--job.dump_folder", str(tmp_path), NPROC="2")
    assert tp.returncode == 0, tp.stderr[-3000:]
    assert "2 processes (TP" in tp.stdout + tp.stderr
    records, single = read_metrics(tmp_path), read_metrics(single_dir)
    for name in ("loss", "aux_loss"):
        assert [r[name] for r in records] == pytest.approx([r[name] for r in single], rel=1e-5)


def test_pipeline_parallel_over_two_processes_matches_one(tmp_path, single_dir):
    # One pipeline microbatch of the 4 sequences, as one process's: each stage adds its layer's auxiliary loss.
    pp = run_train(*SAME_GLOBAL_BATCH, "--parallelism.pipeline_parallel_degree", "2",
                   "--parallelism.pipeline_parallel_schedule", "GPipe",
                   "--parallelism.pipeline_parallel_microbatch_size", "4",
                   "--parallelism.data_parallel_shard_degree", "1", "--job.dump_folder", str(tmp_path), NPROC="2")
    assert pp.returncode == 0, pp.stderr[-3000:]
    records, single = read_metrics(tmp_path), read_metrics(single_dir)
    for name in ("loss", "aux_loss"):
        assert [r[name] for r in records] == pytest.approx([r[name] for r in single], rel=1e-5)


def test_expert_parallel_degree_must_divide_the_experts():
    result = run_train(*MOE, "--parallelism.expert_parallel_degree", "3", "--parallelism.data_parallel_shard_degree",
                       "3", NPROC="3")
    assert result.returncode != 0
    assert "parallelism.expert_parallel_degree=3 does not divide the model's 16 experts" in result.stderr
