"""run_train.sh checks each launch variable before anything starts: a bad value ends with one line naming the
variable, its value and what is valid, exit code 2 (a config error's), and nothing written."""

from __future__ import annotations

import subprocess

import pytest
from run_train_helpers import REPO, user_env

LAUNCH_VARIABLES = ("NPROC", "NGPU", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT",
                    "MAX_RESTARTS", "LOG_RANK")

BAD = [
    ({"NPROC": "abc"}, "NPROC='abc'"),
    ({"NPROC": "0"}, "NPROC='0'"),
    ({"NGPU": "two"}, "NGPU='two'"),
    ({"NNODES": "abc"}, "NNODES='abc'"),
    ({"NNODES": "2", "NODE_RANK": "abc", "MASTER_ADDR": "localhost"}, "NODE_RANK='abc'"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "localhost"}, "NODE_RANK='2'"),
    ({"NNODES": "2", "MASTER_ADDR": "localhost"}, "NODE_RANK=''"),
    ({"NNODES": "2", "NODE_RANK": "0"}, "MASTER_ADDR=''"),
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
