"""run_train.sh checks each launch variable before anything starts: a bad value ends with one line naming the
variable, its value and what is valid, exit code 2 (a config error's), and nothing written. A launch that fails
later names torchrun's report in a file that is still there to read."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from run_train_helpers import REPO, user_env

from dtrain.reliability.launcher import summary

LAUNCH_VARIABLES = ("NPROC", "NGPU", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT",
                    "MAX_RESTARTS", "LOG_RANK")

BAD = [
    ({"NPROC": "abc"}, "NPROC='abc'"),
    ({"NPROC": "0"}, "NPROC='0'"),
    ({"NGPU": "two"}, "NGPU='two'"),
    ({"NPROC": "1", "NGPU": "2"}, "NGPU='2'"),
    ({"NNODES": "abc"}, "NNODES='abc'"),
    ({"NNODES": "2", "NODE_RANK": "abc", "MASTER_ADDR": "localhost"}, "NODE_RANK='abc'"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "localhost"}, "NODE_RANK='2'"),
    ({"NNODES": "2", "MASTER_ADDR": "localhost"}, "NODE_RANK=''"),
    ({"NNODES": "2", "NODE_RANK": "0"}, "MASTER_ADDR=''"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "no such host!"}, "MASTER_ADDR='no such host!'"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "abc"}, "MASTER_PORT='abc'"),
    ({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"NPROC": "2", "MAX_RESTARTS": "abc"}, "MAX_RESTARTS='abc'"),
    ({"NPROC": "2", "MAX_RESTARTS": "-1"}, "MAX_RESTARTS='-1'"),
    ({"NPROC": "2", "LOG_RANK": "abc"}, "LOG_RANK='abc'"),
    ({"NPROC": "2", "LOG_RANK": "2"}, "LOG_RANK='2'"),
]


@pytest.mark.parametrize("env, named", BAD, ids=[named for _, named in BAD])
def test_a_bad_launch_variable_is_one_line_and_exit_2(tmp_path, env, named):
    tmp, run_dir = tmp_path / "tmp", tmp_path / "run"
    tmp.mkdir()
    clean = {k: v for k, v in user_env(TMPDIR=str(tmp), **env).items() if k not in LAUNCH_VARIABLES or k in env}
    result = subprocess.run(["./run_train.sh", "--job.dump_folder", str(run_dir)], cwd=REPO, env=clean,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: {named} is not valid: ") and result.stderr.count("\n") == 1
    assert result.stdout == ""
    assert not run_dir.exists() and not any(tmp.iterdir())  # nothing written, no launch folder either


ADDRESSES_VALID = ["localhost", "node-01.cluster", "gpu_7", "10.0.0.1", "::1", "[fe80::1%eth0]", "2001:db8::1",
                   "::ffff:10.0.0.1", "1:2:3:4:5:6:7:8"]
ADDRESSES_MALFORMED = ["no such host!", "256.1.1.1", "10.0.0", "-node", "a..b", "1::2::3", "1:2:3:4:5:6:7:8:9",
                       "[::1", "12345::1", "::ffff:10.0.0.256"]


@pytest.mark.parametrize(
    "address, valid", [(a, True) for a in ADDRESSES_VALID] + [(a, False) for a in ADDRESSES_MALFORMED]
)
def test_master_addr_must_be_a_hostname_or_an_ip_address(address, valid):
    """The launch check (rendezvous.sh) on its own: a malformed MASTER_ADDR is refused before torchrun, which
    would retry it for a minute and end with its own report."""
    env = {"PATH": os.environ["PATH"], "NODE_RANK": "0", "MASTER_ADDR": address}
    result = subprocess.run(["bash", "-c", "nnodes=2; source scripts/rendezvous.sh --check"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == (0 if valid else 2), result.stderr
    if not valid:
        assert result.stderr == (
            f"error: MASTER_ADDR='{address}' is not valid: use the first node's hostname, IPv4 address or IPv6 "
            "literal (or set RDZV_ENDPOINT)\n"
        )


def test_the_report_named_by_a_launch_that_failed_before_its_workers_is_kept(tmp_path):
    """torchrun failing before any worker made the run folder (a rendezvous that never formed): the report the
    last line names is in the run folder the launch check named, and outlives the launch folder."""
    launch_dir, run_dir = tmp_path / "launch", tmp_path / "runs" / "run"
    (launch_dir / "errors").mkdir(parents=True)
    (launch_dir / "torchrun.log").write_text("torch.distributed.DistNetworkError: failed to resolve host\n")
    line = summary(launch_dir / "errors", launch_dir / "torchrun.log", run_dir, 2, None)
    shutil.rmtree(launch_dir)  # as the launcher does on exit
    report = line.rsplit("(its report: ", 1)[1].removesuffix(")")
    assert report.startswith(f"{run_dir}/torchrun-") and "failed to resolve host" in open(report).read()
