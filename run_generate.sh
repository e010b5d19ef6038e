#!/usr/bin/env bash
# Generate text from a checkpoint on one device (CPU or one GPU), with a KV cache.
#   ./run_generate.sh --checkpoint outputs/debug_model --prompt "def main" --max_new_tokens 40   (newest committed step)
#   ./run_generate.sh --checkpoint /models/Qwen3-0.6B --hf --prompt "Hello" --temperature 0.7 --top_p 0.9
# Prints `ids: ...` (the new token ids) and `text: ...` when a tokenizer is known. --help lists every option;
# config flags (--config, --model.*) apply to dtrain checkpoints as in run_train.sh.
set -euo pipefail
# No cd: paths on the command line are the caller's.
source "$(dirname "$0")/scripts/setup_env.sh"
exec python -m dtrain.generate "$@"
