#!/usr/bin/env bash
# Runs dtrain's test suite, installing what it needs first. Extra arguments go to pytest (e.g. tests/models -k rope).
#   ./scripts/test.sh            the whole suite (each file's name as it runs, then its dots)
#   ./scripts/test.sh --quick    a smoke subset (about a minute on 2 cores): did the install work?
# The quick subset touches every layer once: config loading and validation, the three model families, the train
# step, the data loader, one 2-process FSDP/DDP parity world, checkpoint save and resume, and the trainer's
# command line end to end (a real ./run_train.sh run, a typo's one-line error, --help).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=(
    tests/config/test_config_resolution.py
    tests/config/test_config_validate.py
    tests/models/test_llama3_model.py
    tests/models/test_qwen3.py
    tests/models/test_deepseek_v3.py
    tests/step/test_step.py
    tests/data/test_data_loader.py
    tests/parallelize/test_parity_fsdp_ddp.py
    tests/checkpoint/test_checkpoint_resume.py
    tests/e2e/test_run_train_cli.py::test_debug_model_trains_writes_outputs_and_is_deterministic
    tests/e2e/test_run_train_cli.py::test_unknown_key_is_one_line_exit_2_and_writes_nothing
    tests/e2e/test_run_train_cli.py::test_help_and_print_config_answer_without_training
)
args=()
for arg in "$@"; do
    if [ "$arg" = "--quick" ]; then args+=("${QUICK[@]}"); else args+=("$arg"); fi
done
DTRAIN_EXTRAS=test source scripts/setup_env.sh
python -c 'import sys, torch; print(f"dtrain tests: torch {torch.__version__}, python {sys.version.split()[0]}")'
exec python -m pytest "${args[@]}"
