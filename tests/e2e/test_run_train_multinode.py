"""Multi-node launches on one machine: two run_train.sh "nodes" meeting at a c10d rendezvous on loopback
reproduce the one-node run, and scripts/slurm/train.sbatch trains (and saves on SLURM's SIGTERM) under a fake
SLURM whose srun starts one task per node here and whose scontrol expands the node list.

The fast tests give launch_node.sh a fake run_train.sh (DTRAIN_ROOT) that prints what it was given."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from run_train_helpers import FP32, REPO, TINY, read_metrics, user_env

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
LAUNCH_NODE = REPO / "scripts" / "slurm" / "launch_node.sh"
# One global batch of 4 sequences per step over 2 ranks, fp32, compared at 1e-5 (as test_run_train_parallel).
SAME_GLOBAL_BATCH = [*TINY, "--training.steps", "5", "--training.global_batch_size", "4",
                     "--training.local_batch_size", "2", *FP32]
# Launch settings a developer's shell (or a CI job on a cluster) may carry, which would change what is tested.
INHERITED = ("NPROC", "NGPU", "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_PORT", "MASTER_ADDR",
             "MASTER_PORT", "DTRAIN_ROOT", "CUDA_VISIBLE_DEVICES")

FAKE_SRUN = """#!/usr/bin/env bash
# srun inside an allocation, on one machine: one task per node, each with its node's SLURM variables.
echo "$*" >> "$FAKE_SLURM_DIR/srun_args"
while [[ "${1:-}" == -* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_STEP_NUM_NODES=$SLURM_NNODES "$@" &
    pids+=($!)
    echo $! >> "$FAKE_SLURM_DIR/tasks"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames, for comma-separated node lists.
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: unsupported: $*" >&2; exit 1; }
tr ',' '\\n' <<< "$3"
"""
FAKE_RUN_TRAIN = """#!/usr/bin/env bash
# What launch_node.sh hands over: the environment it computed and the arguments.
for name in NNODES NPROC RDZV_ENDPOINT RDZV_ID; do echo "$name=${!name-<unset>}"; done
for arg in "$@"; do echo "arg=$arg"; done
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """The test environment without SLURM or launch settings from outside; CPU and gloo on loopback, also on a
    GPU machine (two "nodes" on one machine would share its GPU)."""
    env = {k: v for k, v in user_env().items() if not k.startswith("SLURM_") and k not in INHERITED}
    env.update(GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="", **extra)
    return env


def write_executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


class FakeSlurm:
    """A folder with a fake srun (which records its arguments and its tasks' process ids there) and scontrol."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        write_executable(folder / "bin" / "srun", FAKE_SRUN)
        write_executable(folder / "bin" / "scontrol", FAKE_SCONTROL)

    def __call__(self, nodes: int, **extra: str) -> dict[str, str]:
        """The environment of job 4242 on `nodes` nodes (all of them 127.0.0.1), with the fakes on PATH."""
        env = clean_env(SLURM_JOB_ID="4242", SLURM_NNODES=str(nodes),
                        SLURM_JOB_NODELIST=",".join(["127.0.0.1"] * nodes), SLURM_CPUS_PER_TASK="2",
                        SLURM_SUBMIT_DIR=str(REPO), FAKE_SLURM_DIR=str(self.folder))
        env["PATH"] = f"{self.folder / 'bin'}{os.pathsep}{env['PATH']}"
        env.update(extra)
        return env


@pytest.fixture
def fake_slurm(tmp_path) -> FakeSlurm:
    return FakeSlurm(tmp_path / "slurm")


def handed_over(output: str) -> tuple[dict[str, str], list[str]]:
    """The environment and arguments the fake run_train.sh printed."""
    lines = output.splitlines()
    env = dict(line.split("=", 1) for line in lines if not line.startswith("arg="))
    return env, [line[len("arg="):] for line in lines if line.startswith("arg=")]


@pytest.fixture
def fake_checkout(tmp_path):
    """A checkout whose run_train.sh only prints what it was given."""
    root = tmp_path / "checkout"
    write_executable(root / "run_train.sh", FAKE_RUN_TRAIN)
    (root / "scripts" / "slurm").mkdir(parents=True)
    (root / "scripts" / "slurm" / "launch_node.sh").symlink_to(LAUNCH_NODE)
    return root


def launch_node(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH_NODE), *args], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    "gpu_env, nproc",
    [
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "h100:8"}, "4"),
        ({"SLURM_GPUS_PER_NODE": "h100:8"}, "8"),
        ({"SLURM_GPUS_PER_NODE": "2"}, "2"),
        ({"CUDA_VISIBLE_DEVICES": "0,1,3"}, "3"),
        ({"NPROC": "3", "SLURM_GPUS_ON_NODE": "8"}, "3"),
        ({}, "<unset>"),  # run_train.sh's default: the GPUs torch sees, else 1
    ],
    ids=["gpus_on_node", "typed_gpus_per_node", "gpus_per_node", "cuda_visible_devices", "nproc_wins", "cpu"],
)
def test_launch_node_derives_the_launch_from_slurm(fake_slurm, fake_checkout, gpu_env, nproc):
    env = fake_slurm(3, DTRAIN_ROOT=str(fake_checkout), **gpu_env)
    env["SLURM_JOB_NODELIST"] = "gpu-a17,gpu-a18,gpu-b02"
    result = launch_node(env, "--config", "llama3_8b", "--job.description", "two words")
    assert result.returncode == 0, result.stderr
    computed, args = handed_over(result.stdout)
    assert computed == {"NNODES": "3", "NPROC": nproc, "RDZV_ENDPOINT": "gpu-a17:29742", "RDZV_ID": "dtrain-4242"}
    assert args == ["--config", "llama3_8b", "--job.description", "two words"]


def test_sbatch_starts_one_task_per_node_with_the_arguments(fake_slurm, fake_checkout):
    env = fake_slurm(2, DTRAIN_ROOT=str(fake_checkout), RDZV_PORT="31000")
    result = subprocess.run(["bash", str(SBATCH), "--training.steps", "10"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    (srun_args,) = (fake_slurm.folder / "srun_args").read_text().splitlines()
    assert srun_args.startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=2 ")
    computed, args = handed_over(result.stdout)  # both tasks print the same, their lines maybe interleaved
    assert result.stdout.count("RDZV_ENDPOINT=127.0.0.1:31000\n") == 2
    assert computed["NNODES"] == "2" and computed["RDZV_ID"] == "dtrain-4242"
    assert sorted(args) == ["--training.steps", "--training.steps", "10", "10"]


def minimal_path(tmp_path: Path) -> str:
    """A PATH with the tools launch_node.sh uses, but no scontrol (also on a machine that has SLURM)."""
    folder = tmp_path / "tools"
    folder.mkdir()
    for tool in ("bash", "grep", "head", "tr", "dirname"):
        (folder / tool).symlink_to(shutil.which(tool))
    return str(folder)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a' is not a job number"),
        ({"SLURM_NNODES": "two"}, "SLURM_NNODES='two' is not a node count"),
        ({"SLURM_JOB_NODELIST": "127.0.0.1"}, "names 1 host(s), but SLURM_NNODES=2"),
        ({"SLURM_GPUS_PER_NODE": "h100:many"}, "SLURM_GPUS_PER_NODE='h100:many' is not [type:]count"),
        ({"RDZV_PORT": "70000"}, "RDZV_PORT='70000' is not a port"),
        ({"PATH": "minimal"}, "scontrol is not on PATH"),
        ({"DTRAIN_ROOT": "/nonexistent"}, "no run_train.sh in '/nonexistent'"),
    ],
    ids=["no_nodelist", "job_id", "nnodes", "nodelist_count", "gpus", "port", "no_scontrol", "root"],
)
def test_a_bad_slurm_environment_is_one_line(tmp_path, fake_slurm, fake_checkout, change, named):
    env = fake_slurm(2, DTRAIN_ROOT=str(fake_checkout))
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = minimal_path(tmp_path) if value == "minimal" else value
    result = launch_node(env)
    assert result.returncode == 2 and result.stdout == ""  # nothing was launched
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], result.stderr


def test_sbatch_outside_slurm_is_one_line(fake_slurm):
    env = fake_slurm(2)
    del env["SLURM_JOB_ID"]
    result = subprocess.run(["bash", str(SBATCH), "--training.steps", "1"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "SLURM_JOB_ID is not set: submit this script with sbatch" in lines[0]
    assert not (fake_slurm.folder / "srun_args").exists()


@pytest.fixture(scope="module")
def one_node_losses(tmp_path_factory):
    """The reference: the same world size (2) and global batch on one node."""
    run_dir = tmp_path_factory.mktemp("one_node")
    result = subprocess.run(["./run_train.sh", *SAME_GLOBAL_BATCH, "--job.dump_folder", str(run_dir)], cwd=REPO,
                            env=clean_env(NPROC="2"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [r["loss"] for r in read_metrics(run_dir)]


def finish(processes: list[subprocess.Popen], timeout: int = 300) -> list[tuple[int, str]]:
    """(exit status, stderr) of each process; all are killed if one does not end in time."""
    try:
        stderrs = [p.communicate(timeout=timeout)[1] for p in processes]
        return [(p.returncode, stderr) for p, stderr in zip(processes, stderrs)]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_on_loopback_match_one_node(tmp_path, one_node_losses):
    run_dir = tmp_path / "run"  # one folder for both nodes, as on a shared file system
    env = clean_env(NNODES="2", NPROC="1", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", RDZV_ID="loopback")
    nodes = [subprocess.Popen(["./run_train.sh", *SAME_GLOBAL_BATCH, "--job.dump_folder", str(run_dir)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for status, stderr in finish(nodes):
        assert status == 0, stderr[-3000:]
        assert "2 processes (FSDP" in stderr and "training done: 5 steps" in stderr  # each node logs its rank
    assert [r["loss"] for r in read_metrics(run_dir)] == pytest.approx(one_node_losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sbatch_trains_on_two_fake_nodes(tmp_path, fake_slurm, one_node_losses):
    run_dir = tmp_path / "run"
    env = fake_slurm(2, RDZV_PORT=str(free_port()))
    (status, stderr), = finish([subprocess.Popen(
        ["bash", str(SBATCH), *SAME_GLOBAL_BATCH, "--job.dump_folder", str(run_dir)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)])
    assert status == 0, stderr[-3000:]
    assert stderr.count("training done: 5 steps") == 2  # one logging rank per node
    assert [r["loss"] for r in read_metrics(run_dir)] == pytest.approx(one_node_losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sbatch_job_saves_on_slurms_sigterm_and_resumes_when_requeued(tmp_path, fake_slurm):
    # One node with 2 "GPUs": run_train.sh's torchrun under the launcher, as on every node of a real job.
    run_dir = tmp_path / "run"
    steps = 16
    command = ["bash", str(SBATCH), *TINY, "--training.steps", str(steps), "--checkpoint.enable",
               "--checkpoint.interval", "1000", "--job.dump_folder", str(run_dir)]
    env = fake_slurm(1, SLURM_GPUS_PER_NODE="2")
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 2):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.05)
        # What SLURM does on scancel, preemption or the time limit: SIGTERM to each step's task processes (its
        # proctrack/cgroup signals no other process but SIGKILL) and to the batch shell.
        for task in (fake_slurm.folder / "tasks").read_text().split():
            os.kill(int(task), signal.SIGTERM)
        job.send_signal(signal.SIGTERM)
        (status, stderr), = finish([job])
    finally:
        if job.poll() is None:
            job.kill()
    assert status == 0, stderr[-3000:]
    assert "stopped on SIGTERM: every worker exited cleanly" in stderr
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert stopped_at < steps and (run_dir / "checkpoint" / f"step-{stopped_at}").is_dir()

    (status, stderr), = finish([subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True)])  # the requeued job: the same command
    assert status == 0, stderr[-3000:]
    assert "checkpoint: resuming from" in stderr
    assert read_metrics(run_dir)[-1]["step"] == steps
