"""Command-line entry: `python -m dtrain.main [--config NAME] [--section.key value ...]` (run_train.sh calls it).

Everything the user can get wrong is checked here, before any run directory or process group exists, and
reported as one line: `error: <what, and what would be valid>`. DTRAIN_TRACEBACK=1 shows the traceback instead.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from dtrain.errors import DtrainError
from dtrain.reliability.launcher import die_with, record_failure, record_outcome

# `run_train.sh` runs this once with --launcher_check before starting torchrun: it validates the config for the
# coming world size and answers --help / print_config itself. Exit code ANSWERED tells the launcher to stop there.
LAUNCHER_CHECK_FLAG = "--launcher_check"
ANSWERED = 3
RUN_DIR_FILE_ENV = "DTRAIN_RUN_DIR_FILE"
LAUNCH_SHELL_ENV = "DTRAIN_LAUNCH_SHELL_PID"  # run_train.sh's pid, the launch check's parent


def run(argv: list[str]) -> int:
    from dtrain.config import format_help, help_requested, load_config, to_toml

    launcher_check = LAUNCHER_CHECK_FLAG in argv
    argv = [a for a in argv if a != LAUNCHER_CHECK_FLAG]
    if launcher_check and os.environ.get(LAUNCH_SHELL_ENV):  # killed with run_train.sh, not seconds after it
        die_with(int(os.environ[LAUNCH_SHELL_ENV]))
    if help_requested(argv):
        # With --config, the help shows that file's values as the defaults.
        print(format_help(load_config(argv)))
        return ANSWERED if launcher_check else 0
    cfg = load_config(argv)
    if cfg.job.print_config:
        # Printed as the config to train with: saved and passed back with --config, it must train, not print.
        print(to_toml(replace(cfg, job=replace(cfg.job, print_config=False))), end="")
        return ANSWERED if launcher_check else 0
    from dtrain.metrics import setup_logging
    from dtrain.metrics.liveness import liveness

    # Before prepare: its warnings (a tokenizer's renumbered ids, ...) carry the rank tag like every later line.
    # LOG_RANK names a local rank, as run_train.sh's torchrun output filter does: one logging rank per node.
    logger = setup_logging(int(os.environ.get("LOCAL_RANK", "0")))
    if launcher_check:  # its warnings would be said again by the ranks; its errors end the launch in one line
        logger.setLevel(logging.ERROR)
    with liveness():  # a line at least every 30 s, whatever the run is doing
        return prepare_and_train(cfg, launcher_check)


def prepare_and_train(cfg, launcher_check: bool) -> int:
    """The pre-flight, then (unless this is run_train.sh's launch check) the training run."""
    from dtrain.metrics.liveness import doing
    from dtrain.run.prepare import prepare

    doing("checking the config, the tokenizer and the data")
    prepared = prepare(cfg)
    from dtrain.eval.training import check_eval_tasks  # [eval]'s tasks and data, refused before training starts

    eval_tasks = check_eval_tasks(cfg)
    if launcher_check:
        # run_train.sh keeps torchrun's report in the run folder if the run fails.
        if os.environ.get(RUN_DIR_FILE_ENV):
            Path(os.environ[RUN_DIR_FILE_ENV]).write_text(cfg.job.dump_folder)
        return 0
    from dtrain.run.train import train

    build_loss = None
    if cfg.training.dataset == "preference":  # the run package sits below dtrain.preference: it is handed in
        from dtrain.preference import build_preference_loss as build_loss
    add_hooks = None
    if eval_tasks is not None:  # the run package sits below dtrain.eval too: its hooks are handed in
        from functools import partial

        from dtrain.eval.training import add_eval_hooks

        add_hooks = partial(add_eval_hooks, cfg, eval_tasks, prepared.tokenizer, prepared.model_args.max_seq_len)
    train(cfg, prepared, build_loss, add_hooks)
    record_outcome(False, "finished")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run(argv)
    except BrokenPipeError:
        # `--help | head` closed the pipe early: not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except DtrainError as err:
        record_failure(f"error: {err}")
        if os.environ.get("DTRAIN_TRACEBACK"):
            raise
        logging.shutdown()
        print(f"error: {err}", file=sys.stderr)
        if "torchft" in sys.modules:
            # torchft's native threads (its servers, the gloo pairs of a reconfigured group) can abort the
            # interpreter's teardown ("terminate called without an active exception"): the run is over and said,
            # so leave without it.
            sys.stderr.flush()
            os._exit(err.exit_code)
        return err.exit_code
    except Exception as err:  # a bug: its traceback stays, and the launcher still names it in its last line
        record_failure(f"{type(err).__name__}: {err}")
        raise


if __name__ == "__main__":
    sys.exit(main())
