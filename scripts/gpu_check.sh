#!/usr/bin/env bash
# One command that verifies and measures every CUDA path of dtrain on the GPU machine it runs on:
#   1. the CUDA-marked tests (pytest -m cuda: async TP, sharded init, context parallel's ring and masked attention);
#   2. a 1B-class Llama 3 (the 1B flavor with its 128k vocabulary) and Qwen3 1.7B on one GPU, side by side: eager,
#      compile, compile + float8 tensorwise and rowwise (and MXFP8 on Blackwell-class GPUs), in bf16 with fused
#      AdamW (optimizer.implementation auto):
#      tokens/s, MFU in dtrain's convention and torchtitan's, peak memory (scripts/bench_layouts.py);
#   3. one run that writes a CUDA memory snapshot and saves an async checkpoint from pinned memory, then checks
#      that both exist;
#   4. scripts/compile_study.py on the first model: eager, compile default and reduce-overhead, and what the
#      portable compile cache (compile.cache) saves against a cold compile and a warm local cache;
#   5. side by side with torchtitan 0.2.2's own trainer (scripts/bench_vs_torchtitan.py, when torchtitan is
#      installed): the Llama 3 1B-class shape, eager, compile and compile + float8, losses of every step compared;
#   6. packed sequences on the first model (training.attention_mask block_causal, batch 1): the dense mask against
#      FlexAttention's block masks at seq 2k, 8k and 32k (scripts/bench_layouts.py).
# It prints one table per model and writes everything to GPU_CHECK_OUT (default gpu_check_<date>.md); record the
# table in docs/benchmarks.md with the exact command.
#
#   scripts/gpu_check.sh                 # on a GPU machine
#   DRY_RUN=1 scripts/gpu_check.sh       # anywhere: the same steps on the CPU with the debug model, a few steps
#   GPU_CHECK_MODELS="llama3 1B" GPU_CHECK_STUDY_MODES=default scripts/gpu_check.sh   # a shorter check
#
# GPU_CHECK_MODELS: ";"-separated "name flavor" pairs (the first also runs the snapshot and the compile study);
# GPU_CHECK_STUDY_MODES: the compile study's --modes ("none" skips it). The CUDA tests' whole log is written beside
# the report (its name with .tests.log). A failed benchmark variant or study gets its row and the script goes on,
# so one broken path never hides the others' figures; the script still exits non-zero at the end.
#
# Without CUDA it always runs dry: the tests skip, float8 is emulated, and the figures mean nothing; the dry run
# only shows that the script and every variant work.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${GPU_CHECK_OUT:-gpu_check_$(date +%Y%m%d_%H%M%S).md}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXX")
trap 'rm -rf "$WORK"' EXIT

if [[ "${DRY_RUN:-0}" != 1 ]] && ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device here; running dry (CPU, debug model)" >&2
    DRY_RUN=1
fi
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    STEPS=4; WARMUP=1
    MODELS=("llama3 debugmodel")
    SHAPE=(--model.tokenizer byte --training.seq_len 64 --training.mixed_precision_param float32)
    BATCH=2
    CUDA_ONLY=(--checkpoint.async_mode async)  # pinned staging and memory snapshots are refused without CUDA
    STUDY_MODES=default
    SIDE_BY_SIDE=(--dry_run --shapes debug --variants eager --rounds 1 --steps 3 --warmup 1)
    PACKED_SEQS=(64); PACKED_VARIANTS=packed_dense  # FlexAttention has no CPU backward
else
    STEPS=30; WARMUP=10
    MODELS=("llama3 1B" "qwen3 1.7B")
    SHAPE=(--model.tokenizer byte --model.args.vocab_size 128256 --training.seq_len 2048)
    BATCH=4
    # A snapshot is written every profile_freq steps: every 2 of the 4 steps here.
    CUDA_ONLY=(--checkpoint.async_mode async_with_pinned_mem --profiling.enable_memory_snapshot --profiling.profile_freq 2)
    STUDY_MODES=default,reduce-overhead  # CUDA graphs: what they add on top of the compiled kernels
    SIDE_BY_SIDE=(--shapes llama3_1b --variants eager,compile,compile_float8 --rounds 2 --steps "$STEPS"
                  --warmup "$WARMUP" --batch "$BATCH")
    PACKED_SEQS=(2048 8192 32768); PACKED_VARIANTS=packed_dense,packed_flex
fi
if [[ -n "${GPU_CHECK_MODELS:-}" ]]; then
    IFS=';' read -r -a MODELS <<<"$GPU_CHECK_MODELS"
fi
STUDY_MODES=${GPU_CHECK_STUDY_MODES:-$STUDY_MODES}
failed=()

{
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    "$PYTHON" -c 'import torch; d = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"; print(f"torch {torch.__version__}, {d}")'
    echo "command: DRY_RUN=${DRY_RUN:-0} GPU_CHECK_MODELS=\"${MODELS[*]}\" GPU_CHECK_STUDY_MODES=$STUDY_MODES scripts/gpu_check.sh"
} | tee "$OUT"

echo -e "\n## CUDA-marked tests\n" | tee -a "$OUT"
"$PYTHON" -m pytest -q -rfE -p no:cacheprovider -m cuda tests >"${OUT%.md}.tests.log" 2>&1 || failed+=(tests)
{ grep -E '^(FAILED|ERROR) |^[0-9]+ (passed|failed|skipped|error)' "${OUT%.md}.tests.log" || true; } | tail -n 30 | tee -a "$OUT"

VARIANTS=eager,compile,compile_float8_tensorwise,compile_float8_rowwise
# MX (block-scaled) matmuls exist from Blackwell (compute capability 10.0) on; elsewhere the config refuses them.
blackwell='import sys, torch; sys.exit(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0)))'
if "$PYTHON" -c "$blackwell"; then
    VARIANTS+=,compile_mxfp8
fi
for model in "${MODELS[@]}"; do
    read -r name flavor <<<"$model"
    echo -e "\n## $name $flavor: one GPU, global batch $BATCH\n" | tee -a "$OUT"
    rm -f "$WORK/table.md"
    "$PYTHON" scripts/bench_layouts.py --variants "$VARIANTS" --steps "$STEPS" --warmup "$WARMUP" --batch "$BATCH" \
        --output "$WORK/table.md" -- --model.name "$name" --model.flavor "$flavor" "${SHAPE[@]}" \
        >/dev/null 2>"$WORK/bench.err" || { failed+=("bench $name"); tail -n 20 "$WORK/bench.err" | tee -a "$OUT"; }
    if [[ -f "$WORK/table.md" ]]; then tee -a "$OUT" < "$WORK/table.md"; fi
done

read -r name flavor <<<"${MODELS[0]}"
echo -e "\n## side by side with torchtitan 0.2.2's trainer: one GPU\n" | tee -a "$OUT"
# Found, not imported: importing it needs triton, which the CPU build of torch lacks (the dry run stubs it).
if "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torchtitan") is None)'; then
    rm -f "$WORK/side.md"
    "$PYTHON" scripts/bench_vs_torchtitan.py "${SIDE_BY_SIDE[@]}" --output "$WORK/side.md" >/dev/null \
        2>"$WORK/side.err" || { failed+=("side by side"); tail -n 20 "$WORK/side.err" | tee -a "$OUT"; }
    if [[ -f "$WORK/side.md" ]]; then tee -a "$OUT" < "$WORK/side.md"; fi
else
    echo "skipped: torchtitan is not installed here (pip install torchtitan==0.2.2)" | tee -a "$OUT"
fi

for seq in "${PACKED_SEQS[@]}"; do
    echo -e "\n## $name $flavor: packed sequences at seq $seq, batch 1: dense mask against FlexAttention\n" | tee -a "$OUT"
    rm -f "$WORK/packed.md"
    "$PYTHON" scripts/bench_layouts.py --variants "$PACKED_VARIANTS" --steps "$STEPS" --warmup "$WARMUP" --batch 1 \
        --output "$WORK/packed.md" -- --model.name "$name" --model.flavor "$flavor" "${SHAPE[@]}" \
        --training.seq_len "$seq" >/dev/null 2>"$WORK/packed.err" \
        || { failed+=("packed $seq"); tail -n 20 "$WORK/packed.err" | tee -a "$OUT"; }
    if [[ -f "$WORK/packed.md" ]]; then tee -a "$OUT" < "$WORK/packed.md"; fi
done

echo -e "\n## memory snapshot and async checkpoint (pinned memory)\n" | tee -a "$OUT"
NPROC=1 ./run_train.sh --training.dataset synthetic --training.steps 4 --job.dump_folder "$WORK/snapshot_run" \
    --model.name "$name" --model.flavor "$flavor" "${SHAPE[@]}" --training.local_batch_size "$BATCH" \
    --checkpoint.enable --checkpoint.interval 2 "${CUDA_ONLY[@]}" >"$WORK/snapshot_run.log" 2>&1 \
    || { failed+=(snapshot); tail -n 20 "$WORK/snapshot_run.log" | tee -a "$OUT"; }
snapshots=$(find "$WORK/snapshot_run" -name '*.pickle' 2>/dev/null | wc -l || true)
checkpoints=$(find "$WORK/snapshot_run/checkpoint" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l || true)
echo "memory snapshot files: $snapshots (CUDA only); checkpoints saved asynchronously: $checkpoints" | tee -a "$OUT"
if [[ "$STUDY_MODES" != none ]]; then
    echo -e "\n## ${MODELS[0]}: compile modes, cold compile against the portable compile cache\n" | tee -a "$OUT"
    "$PYTHON" scripts/compile_study.py --config debug_model --modes "$STUDY_MODES" --steps 6 --cache \
        --model.name "$name" --model.flavor "$flavor" "${SHAPE[@]}" --training.local_batch_size "$BATCH" \
        --training.dataset synthetic | tee -a "$OUT" || {
        status=$?
        failed+=("compile study")
        echo "compile study: exit $status (a failed variant names its error in its row)" | tee -a "$OUT"
    }
fi

echo -e "\nwritten to $OUT"
if (( ${#failed[@]} )); then
    echo "gpu_check: failed: ${failed[*]}" >&2
    exit 1
fi
