"""Multi-node launches on one machine: two run_train.sh "nodes" meeting at a c10d rendezvous on loopback
reproduce the one-node run, and scripts/slurm/train.sbatch trains under a fake SLURM whose srun starts one task
per node here, whose scontrol expands the node list and records a requeue, and whose scancel signals the tasks;
stopped for the time limit, the job saves, requeues itself and the requeued job resumes.

The fast tests give launch_node.sh a fake run_train.sh (DTRAIN_ROOT) that prints what it was given, and with
FAKE_TRAIN=run acts as a trainer that saves and exits 0 on SIGTERM."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_train_helpers import FP32, REPO, TINY, read_metrics, user_env

SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
LAUNCH_NODE = REPO / "scripts" / "slurm" / "launch_node.sh"
SETUP_ENV = REPO / "scripts" / "setup_env.sh"
# One global batch of 4 sequences per step over 2 ranks, fp32, compared at 1e-5 (as test_run_train_parallel).
SAME_GLOBAL_BATCH = [*TINY, "--training.steps", "5", "--training.global_batch_size", "4",
                     "--training.local_batch_size", "2", *FP32]
# Launch settings a developer's shell (or a CI job on a cluster) may carry, which would change what is tested.
INHERITED = ("NPROC", "NGPU", "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "RDZV_PORT", "MASTER_ADDR",
             "MASTER_PORT", "DTRAIN_ROOT", "CUDA_VISIBLE_DEVICES", "DTRAIN_NO_INSTALL", "DTRAIN_REQUEUE")

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
# scontrol show hostnames, for comma-separated node lists; scontrol requeue JOB, recorded.
case "$1" in
    show) [ "$2" = hostnames ] || { echo "fake scontrol: unsupported: $*" >&2; exit 1; }
          tr ',' '\\n' <<< "$3" ;;
    requeue) echo "$2" >> "$FAKE_SLURM_DIR/requeued" ;;
    *) echo "fake scontrol: unsupported: $*" >&2; exit 1 ;;
esac
"""
FAKE_SCANCEL = """#!/usr/bin/env bash
# scancel --signal=SIG JOB: SIG to every task of the job's steps, and not to the batch shell, as SLURM does.
echo "$*" >> "$FAKE_SLURM_DIR/scancel_args"
[[ "$1" == --signal=* ]] || { echo "fake scancel: unsupported: $*" >&2; exit 1; }
for task in $(cat "$FAKE_SLURM_DIR/tasks"); do kill -s "${1#--signal=}" "$task" 2>/dev/null || true; done
"""
FAKE_RUN_TRAIN = """#!/usr/bin/env bash
# What launch_node.sh hands over: the environment it computed and the arguments.
for name in NNODES NPROC RDZV_ENDPOINT RDZV_ID DTRAIN_NO_INSTALL; do echo "$name=${!name-<unset>}"; done
for arg in "$@"; do echo "arg=$arg"; done
# FAKE_TRAIN=run: a trainer that runs until SIGTERM, then "saves" and exits FAKE_SAVE_STATUS (default 0).
if [ "${FAKE_TRAIN:-}" = run ]; then
    trap 'echo "node $SLURM_NODEID: saved on SIGTERM" >&2; exit "${FAKE_SAVE_STATUS:-0}"' TERM
    touch "$FAKE_SLURM_DIR/running.$SLURM_NODEID"
    while :; do sleep 0.05; done
fi
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
    """A folder with a fake srun (which records its arguments and its tasks' process ids there), scontrol (which
    records a requeue there) and scancel."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        write_executable(folder / "bin" / "srun", FAKE_SRUN)
        write_executable(folder / "bin" / "scontrol", FAKE_SCONTROL)
        write_executable(folder / "bin" / "scancel", FAKE_SCANCEL)

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
    """A checkout whose run_train.sh only prints what it was given; its setup_env.sh is the real one, and the
    test's environment (user_env's VIRTUAL_ENV) is ready for it."""
    root = tmp_path / "checkout"
    write_executable(root / "run_train.sh", FAKE_RUN_TRAIN)
    (root / "scripts" / "slurm").mkdir(parents=True)
    (root / "scripts" / "slurm" / "launch_node.sh").symlink_to(LAUNCH_NODE)
    (root / "scripts" / "setup_env.sh").symlink_to(SETUP_ENV)
    for name in ("pyproject.toml", "setup.py"):  # what the environment's install stamp is checked against
        (root / name).symlink_to(REPO / name)
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
    assert computed == {"NNODES": "3", "NPROC": nproc, "RDZV_ENDPOINT": "gpu-a17:29742", "RDZV_ID": "dtrain-4242",
                        "DTRAIN_NO_INSTALL": "1"}  # the node uses the environment built on the login node
    assert args == ["--config", "llama3_8b", "--job.description", "two words"]


def test_sbatch_starts_one_task_per_node_with_the_arguments(fake_slurm, fake_checkout):
    env = fake_slurm(2, DTRAIN_ROOT=str(fake_checkout), RDZV_PORT="31000")
    result = subprocess.run(["bash", str(SBATCH), "--training.steps", "10"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    # The environment was checked once, before srun, with the same command the login node builds it with.
    assert f"dtrain: Python environment ready: {sys.prefix}" in result.stderr.splitlines()
    (srun_args,) = (fake_slurm.folder / "srun_args").read_text().splitlines()
    assert srun_args.startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=2 ")
    computed, args = handed_over(result.stdout)  # both tasks print the same, their lines maybe interleaved
    assert result.stdout.count("RDZV_ENDPOINT=127.0.0.1:31000\n") == 2
    assert computed["NNODES"] == "2" and computed["RDZV_ID"] == "dtrain-4242"
    assert sorted(args) == ["--training.steps", "--training.steps", "10", "10"]
    assert not (fake_slurm.folder / "requeued").exists()  # a run that finished is not requeued


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


def test_sbatch_with_a_bad_requeue_setting_is_one_line(fake_slurm, fake_checkout):
    env = fake_slurm(2, DTRAIN_ROOT=str(fake_checkout), DTRAIN_REQUEUE="yes")
    result = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: DTRAIN_REQUEUE='yes' is not 1 ") and "or 0" in lines[0]
    assert not (fake_slurm.folder / "srun_args").exists()


def without_active_environment(env: dict[str, str]) -> dict[str, str]:
    """As a job submitted from a shell with no virtualenv or conda env active: the checkout's .venv is used."""
    return {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}


@pytest.mark.parametrize("venv", ["missing", "stale"])
def test_sbatch_without_a_ready_environment_is_one_line_before_srun(fake_slurm, fake_checkout, venv):
    # A compute node never creates or installs the environment (no internet; every node would install into the
    # shared checkout at once): the job stops in one line saying what to run on the login node.
    if venv == "stale":  # an environment without dtrain, as before the first install or after a changed pyproject
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fake_checkout / ".venv")], check=True,
                       timeout=60)
    before = sorted(p.relative_to(fake_checkout) for p in fake_checkout.rglob("*"))
    env = without_active_environment(fake_slurm(2, DTRAIN_ROOT=str(fake_checkout)))
    result = subprocess.run(["bash", str(SBATCH), "--training.steps", "1"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "DTRAIN_NO_INSTALL=1" in lines[0], result.stderr
    assert f"run {fake_checkout}/scripts/setup_env.sh once on the login node" in lines[0]
    assert ("no Python environment at" if venv == "missing" else "is not ready for this checkout") in lines[0]
    assert not (fake_slurm.folder / "srun_args").exists()  # no node was started
    assert sorted(p.relative_to(fake_checkout) for p in fake_checkout.rglob("*")) == before  # nothing installed


def wait_for(condition, job: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended before {what}: {job.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "how, extra, requeued, status, said",
    [
        ("time_limit", {}, True, 0, "requeueing job 4242, which resumes from it"),
        ("time_limit", {"DTRAIN_REQUEUE": "0"}, False, 0, "not requeued (DTRAIN_REQUEUE=0)"),
        ("time_limit", {"FAKE_SAVE_STATUS": "1"}, False, 1, "saved on SIGTERM"),
        ("scancel", {}, False, 0, "SIGTERM reached the job (scancel or preemption): it will not requeue"),
    ],
    ids=["time_limit", "requeue_off", "save_failed", "cancelled"],
)
def test_sbatch_requeues_only_a_job_stopped_for_its_time_limit(fake_slurm, fake_checkout, how, extra, requeued,
                                                             status, said):
    env = fake_slurm(2, DTRAIN_ROOT=str(fake_checkout), FAKE_TRAIN="run", **extra)
    job = subprocess.Popen(["bash", str(SBATCH), "--training.steps", "10"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: len(list(fake_slurm.folder.glob("running.*"))) == 2, job, "two running tasks")
        if how == "time_limit":  # --signal=B:USR1@300: SIGUSR1 to the batch shell alone
            job.send_signal(signal.SIGUSR1)
        else:  # scancel (and preemption): SIGTERM to the tasks and the batch shell
            for task in (fake_slurm.folder / "tasks").read_text().split():
                os.kill(int(task), signal.SIGTERM)
            job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode == status, stderr
    assert stderr.count("saved on SIGTERM") == 2 and said in stderr, stderr
    requeue = fake_slurm.folder / "requeued"
    assert (requeue.read_text() if requeue.exists() else "") == ("4242\n" if requeued else "")
    if how == "time_limit":  # the tasks were stopped as SLURM's --signal=TERM@300 would have: SIGTERM to each
        assert (fake_slurm.folder / "scancel_args").read_text() == "--signal=TERM 4242\n"


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
def test_sbatch_job_stopped_for_its_time_limit_saves_requeues_itself_and_resumes(tmp_path, fake_slurm):
    # One node with 2 "GPUs": run_train.sh's torchrun under the launcher, as on every node of a real job, with the
    # environment checked on the "login node" and DTRAIN_NO_INSTALL=1 on the node.
    run_dir = tmp_path / "run"
    steps = 16
    command = ["bash", str(SBATCH), *TINY, "--training.steps", str(steps), "--checkpoint.enable",
               "--checkpoint.interval", "1000", "--job.dump_folder", str(run_dir)]
    env = fake_slurm(1, SLURM_GPUS_PER_NODE="2")
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 2):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # --signal=B:USR1@300: the time limit is near
        (status, stderr), = finish([job])
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert status == 0, stderr[-3000:]
    assert "stopped on SIGTERM: every worker exited cleanly" in stderr and "requeueing job 4242" in stderr
    assert (fake_slurm.folder / "requeued").read_text() == "4242\n"
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert stopped_at < steps and (run_dir / "checkpoint" / f"step-{stopped_at}").is_dir()

    # The requeued job: the same command, SLURM_RESTART_COUNT=1. It resumes, finishes and is not requeued again.
    (status, stderr), = finish([subprocess.Popen(command, env={**env, "SLURM_RESTART_COUNT": "1"},
                                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)])
    assert status == 0, stderr[-3000:]
    assert "checkpoint: resuming from" in stderr
    assert read_metrics(run_dir)[-1]["step"] == steps
    assert (fake_slurm.folder / "requeued").read_text() == "4242\n"
