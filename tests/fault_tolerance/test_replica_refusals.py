"""Replica groups that cannot work as configured are refused in one line before they train: a lighthouse that does
not answer, two launches under one replica id, and the config's own contradictions."""

import socket

import pytest

from dtrain.config import load_config
from dtrain.config.fault_tolerance_checks import check_replica_launch
from dtrain.errors import ConfigError
from tests.e2e.run_train_helpers import run_train
from tests.fault_tolerance.replica_harness import SHAPE, Group, groups_ended, lighthouse, read_metrics

GROUPS = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


def assert_refused_in_one_line(code: int, stderr: str, expected: str) -> None:
    """A non-zero exit whose stderr ends in the one `error:` line expected, with no traceback and no step."""
    assert code != 0, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, stderr[-2000:]
    assert "Traceback" not in stderr and "step 1/" not in stderr, stderr[-2000:]


def closed_port() -> int:
    """A port nothing listens on: one the kernel just handed out, released again."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_an_unreachable_lighthouse_is_refused_in_one_line(tmp_path):
    address = f"http://localhost:{closed_port()}"
    result = run_train(*SHAPE, *GROUPS, "--job.dump_folder", str(tmp_path / "run"), timeout=60,
                       TORCHFT_LIGHTHOUSE=address)
    assert_refused_in_one_line(result.returncode, result.stderr, f"torchft's lighthouse at {address} does not answer")
    assert not read_metrics(tmp_path / "run")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "semi_sync", [[], ["--fault_tolerance.semi_sync_method", "local_sgd"]], ids=["sync", "local_sgd"]
)
def test_two_groups_under_one_replica_id_are_both_refused(tmp_path, semi_sync):
    # min_replicas 2: the first quorum holds both launches, so neither trains a step alone before the check; under
    # local_sgd the first quorum is the first synchronization's, after sync_steps steps of each group alone.
    args = ["--training.steps", "20", "--fault_tolerance.sync_steps", "2", *semi_sync]
    with lighthouse(min_replicas=2) as address, groups_ended() as started:
        started += [Group(tmp_path / f"launch{n}", 0, address, *args) for n in (0, 1)]
        outcomes = [group.finish(timeout=90) for group in started]
    for group, (code, stderr) in zip(started, outcomes):
        assert_refused_in_one_line(code, stderr, "fault_tolerance.replica_id 0 is used by 2 replica groups at once")
        assert len(read_metrics(group.folder)) == (1 if semi_sync else 0)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--fault_tolerance.min_replica_size", "3"], "fault_tolerance.min_replica_size 3 is more than the 2"),
        (["--fault_tolerance.replica_id", "2"], "fault_tolerance.replica_id 2 is outside [0, "),
    ],
    ids=["min_replica_size", "replica_id"],
)
def test_group_counts_that_contradict_each_other_are_config_errors(flags, expected):
    with pytest.raises(ConfigError) as refused:
        load_config([*GROUPS, "--fault_tolerance.lighthouse", "http://localhost:29510", *flags], env={})
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_fault_tolerance_without_a_lighthouse_is_refused_before_the_run():
    cfg = load_config(GROUPS, env={})
    with pytest.raises(ConfigError, match="fault_tolerance.enable needs torchft's lighthouse") as refused:
        check_replica_launch(cfg, cuda=False, env={})
    assert "\n" not in str(refused.value)
    check_replica_launch(cfg, cuda=False, env={"TORCHFT_LIGHTHOUSE": "http://localhost:29510"})  # the variable
    cfg.fault_tolerance.lighthouse = "http://localhost:29510"
    check_replica_launch(cfg, cuda=False, env={})  # or the key


def test_nccl_between_the_groups_is_refused_without_cuda():
    cfg = load_config([*GROUPS, "--fault_tolerance.process_group", "nccl"], env={})
    cfg.fault_tolerance.lighthouse = "http://localhost:29510"
    with pytest.raises(ConfigError, match="process_group = nccl needs CUDA GPUs; this run is on the CPU: use gloo"):
        check_replica_launch(cfg, cuda=False)
    check_replica_launch(cfg, cuda=True)
