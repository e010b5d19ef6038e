"""scripts/estimate.py: a layout built on paper (meta device, fake process group) holds exactly what a run of it
holds; the report's numbers, the JSON keys, the refusals, and the largest configs at scale."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from run_train_helpers import FP32, TINY, run_train  # noqa: E402

from dtrain.config import load_config  # noqa: E402
from dtrain.estimate import estimate, load_hardware  # noqa: E402

MIB = 1024**2
LAYOUTS = {
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
    "pp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"],
    "ddp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "2"],
    "cp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"],
    "ep2_moe": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe_small", "--model.args.n_layers", "2",
                "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"],
}
# Four ranks: the combinations (one world each costs ~10 s more than two ranks).
LAYOUTS_4 = {
    "fsdp2_tp2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
}


def run_estimate(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/estimate.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(LAYOUTS) + sorted(LAYOUTS_4))
def test_state_bytes_are_what_the_run_of_the_layout_holds(layout, tmp_path):
    nproc = 4 if layout in LAYOUTS_4 else 2
    args = [*TINY, *FP32, "--training.steps", "1", *{**LAYOUTS, **LAYOUTS_4}[layout]]
    result = run_train(*args, "--job.dump_folder", str(tmp_path / "run"), NPROC=str(nproc))
    assert result.returncode == 0, result.stderr[-3000:]
    logged = {}
    for rank, params, grads, optimizer in re.findall(
        r"\[rank(\d)\].*memory on this rank: params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer ([\d.]+) MiB",
        result.stdout + result.stderr,
    ):
        logged[int(rank)] = (float(params), float(grads), float(optimizer))
    estimated = estimate(load_config(args), nproc, load_hardware("cpu"))
    assert len(estimated.stages) == (2 if layout == "pp2" else 1)
    assert 0 in logged  # rank 0 logs its own stage's state (the first)
    for stage in estimated.stages:
        if stage.rank in logged:
            m = stage.memory
            expected = (m.params / MIB, m.grads / MIB, m.optimizer / MIB)
            assert logged[stage.rank] == pytest.approx(expected, abs=0.006)


def test_the_report_and_its_json(tmp_path):
    out = tmp_path / "e.json"
    result = run_estimate("--config", "debug_model.toml", "--world_size", "4", "--hardware", "h100",
                          "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
                          "--training.global_batch_size", "16", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stage 0 (rank 0)" in result.stdout and "stage 1 (rank 2)" in result.stdout
    data = json.loads(out.read_text())
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "total_bytes",
                "bubble_fraction", "comm_bytes_per_step", "step_time_s", "tokens_per_s_per_device", "mfu"):
        assert key in data, key
    assert data["total_bytes"] == max(stage["total_bytes"] for stage in data["stages"])
    assert 0 < data["bubble_fraction"] < 1
    assert any(name.startswith("tp ") for name in data["comm_bytes_per_step"])
    assert any(name.startswith("pp ") for name in data["comm_bytes_per_step"])
    assert 0 < data["mfu"] < 1 and data["step_time_s"] > 0


@pytest.mark.slow
def test_405b_on_512_devices_and_70b_on_64(tmp_path):
    for config, world in (("llama3_405b.toml", "512"), ("llama3_70b.toml", "64")):
        result = run_estimate("--config", config, "--world_size", world, "--json", str(tmp_path / "e.json"))
        assert result.returncode == 0, result.stderr[-3000:]
        data = json.loads((tmp_path / "e.json").read_text())
        assert data["world_size"] == int(world) and data["total_bytes"] > 0
        assert data["comm_bytes_per_step"]["fsdp all_gather (params)"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "debug_model.toml", "--world_size", "4", "--hardware", "tpu"], "--hardware 'tpu' is not a profile"),
        (["--config", "debug_model.toml", "--world_size", "4", "--parallelism.tensor_parallel_degree", "3"],
         "tensor_parallel_degree"),
    ],
)
def test_bad_input_is_one_line(args, message):
    result = run_estimate(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
