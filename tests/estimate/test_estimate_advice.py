"""The estimator's report is a table with one verdict line, and a layout that does not fit is followed by the
changes that make it fit: each one's figures are a fresh estimate of the command plus its flags, and it fits;
a layout that fits gets none; when nothing fits, the closest is named."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dtrain.config import load_config
from dtrain.estimate import estimate, format_report, load_hardware
from dtrain.estimate.advice import changes_that_fit, format_changes

REPO = Path(__file__).resolve().parents[2]
# The debug model with a batch whose activations dominate: every kind of change has something to save.
ARGS = ["--config", "debug_model", "--training.seq_len", "2048", "--training.local_batch_size", "16"]
WORLD = 2
GIB = 2**30


def h100_with(memory_bytes: float):
    """The h100 profile (so CPU offload is a candidate) with a device of `memory_bytes`."""
    return replace(load_hardware("h100"), memory_gib=memory_bytes / GIB)


def base_total() -> int:
    return estimate(load_config(ARGS), WORLD, load_hardware("h100")).busiest.memory.total


def test_each_suggestion_is_the_fresh_estimate_of_its_flags_and_fits():
    hardware = h100_with(0.6 * base_total())
    advice = changes_that_fit(ARGS, WORLD, hardware)
    assert advice.fitting and advice.closest is None
    kinds = {s.change.flags[0] for s in advice.fitting}
    assert {"--activation_checkpoint.mode", "--training.local_batch_size"} <= kinds, kinds
    for s in advice.fitting:
        fresh = estimate(load_config([*ARGS, *s.change.flags]), WORLD, hardware)  # no parts cache
        assert fresh.busiest.memory.total == s.total_bytes <= hardware.memory_gib * GIB
        assert fresh.step_time_s == pytest.approx(s.estimate.step_time_s)
    # Fastest first among the changes whose cost the step time shows; offload (not modelled) after them.
    costs = [s.change.cost for s in advice.fitting]
    assert costs == sorted(costs)
    modelled = [s.estimate.step_time_s for s in advice.fitting if s.change.cost == 0]
    assert modelled == sorted(modelled)
    text = format_changes(advice, hardware)
    assert text.startswith("changes that make it fit") and " ".join(advice.fitting[0].change.flags) in text


def test_smaller_microbatches_keep_the_global_batch():
    hardware = h100_with(0.6 * base_total())
    fitting = changes_that_fit(ARGS, WORLD, hardware).fitting
    batch = [s for s in fitting if s.change.flags[0] == "--training.local_batch_size"]
    assert batch, "a smaller microbatch with accumulation fits"
    cfg = load_config([*ARGS, *batch[0].change.flags])
    assert cfg.training.global_batch_size == 16 * WORLD and cfg.training.local_batch_size < 16


def test_when_nothing_fits_the_closest_is_named():
    hardware = h100_with(GIB / 1024)  # 1 MiB: nothing fits
    advice = changes_that_fit(ARGS, WORLD, hardware)
    assert not advice.fitting and advice.closest is not None and advice.tried > 0
    assert advice.closest.total_bytes < base_total()
    text = format_changes(advice, hardware)
    assert text.startswith(f"none of the {advice.tried} changes tried") and "the closest" in text


def test_the_report_is_a_table_with_one_verdict():
    cfg = load_config(ARGS)
    fits = estimate(cfg, WORLD, load_hardware("h100"))
    text = format_report(fits, "bfloat16")
    rows = [line.split("  ")[0] for line in text.splitlines()]
    for row in ("memory per rank (GiB)", "params", "grads", "optimizer state", "activations",
                "gathered params (FSDP)", "batches", "total", "device memory (h100)"):
        assert row in rows, row
    verdicts = [line for line in text.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 1 and verdicts[0].startswith("verdict: fits: stage 0 (rank 0) needs")
    tight = replace(fits, hardware=h100_with(fits.busiest.memory.total - 1))
    assert format_report(tight, "bfloat16").splitlines()[-1].startswith("verdict: DOES NOT FIT: stage 0 (rank 0)")


def run_estimate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/estimate.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180)


def test_the_script_prints_and_writes_the_changes_only_when_it_does_not_fit(tmp_path):
    # 32 sequences of 16k tokens per rank: about 39 GiB against the cpu profile's 21.9.
    big = ["--config", "debug_model", "--world_size", "2", "--hardware", "cpu", "--training.seq_len", "16384",
           "--training.local_batch_size", "32", "--json", str(tmp_path / "big.json")]
    result = run_estimate(*big)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: DOES NOT FIT" in result.stdout and "changes that make it fit" in result.stdout
    data = json.loads((tmp_path / "big.json").read_text())
    assert data["fits"] is False and data["suggestions"] and data["closest"] is None
    for s in data["suggestions"]:
        assert s["fits"] and s["total_bytes"] <= data["device_memory_bytes"]
        assert " ".join(s["flags"]) in result.stdout
    small = ["--config", "debug_model", "--world_size", "2", "--hardware", "cpu", "--json", str(tmp_path / "ok.json")]
    result = run_estimate(*small)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verdict: fits" in result.stdout and "changes" not in result.stdout
    assert json.loads((tmp_path / "ok.json").read_text())["suggestions"] == []


@pytest.mark.parametrize("flags", [
    ["--activation_checkpoint.mode", "full"],
    ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    ["--training.enable_cpu_offload"],
    ["--optimizer.name", "AdamW8bit", "--training.local_batch_size", "4", "--training.global_batch_size", "32"],
])
def test_reused_parts_give_the_fresh_estimate(flags):
    """The advice re-estimates variants on the model parts built for the command (estimator._parallelized_parts):
    a change of AC, offload, optimizer or batch gives what a fresh build gives."""
    hardware, cache = load_hardware("h100"), {}
    estimate(load_config(ARGS), WORLD, hardware, cache)
    reused = estimate(load_config([*ARGS, *flags]), WORLD, hardware, cache)
    assert len(cache) == 1  # no rebuild
    fresh = estimate(load_config([*ARGS, *flags]), WORLD, hardware)
    assert reused.busiest.memory == fresh.busiest.memory and reused.step_time_s == fresh.step_time_s
