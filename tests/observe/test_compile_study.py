"""scripts/compile_study.py: results read from run folders into one table, bad arguments in one line, and one
real study (eager against compile default) on a tiny model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from tests.e2e.run_train_helpers import REPO, user_env

spec = importlib.util.spec_from_file_location("compile_study", REPO / "scripts" / "compile_study.py")
compile_study = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = compile_study  # its dataclass looks the module up while it is being defined
spec.loader.exec_module(compile_study)

# A 1-layer, dim-64 Llama on 32-token sequences, only the model compiled, by aot_eager: the study gives every
# variant a cold inductor cache, and inductor's cold C++ builds alone take 20-50 s on 2 busy cores.
TINY_MODEL = ["--model.args.n_layers", "1", "--model.args.dim", "64", "--model.args.n_heads", "4",
              "--model.args.n_kv_heads", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
              "--compile.components", "model", "--compile.backend", "aot_eager"]


def write_run(run_dir, elapsed, memory=(0.5,), report=None):
    """A fake run folder: one metrics.jsonl record per step (and a validation record), a compile report."""
    run_dir.mkdir(parents=True)
    records = [{"step": step, "loss": 1.0, "memory_gib": memory[min(step - 1, len(memory) - 1)], "elapsed_s": t}
               for step, t in enumerate(elapsed, 1)]
    records.append({"step": len(elapsed), "val_loss": 2.0})  # validation records carry no times
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if report is not None:
        (run_dir / "compile_report.json").write_text(json.dumps(report))


def report(compile_time_s=12.5, breaks=1, recompiles=2, hit=0, miss=4):
    return {"compile_time_s": compile_time_s, "graph_break_count": breaks,
            "recompiles": [{"reason": "size mismatch"}] * recompiles,
            "cache": {"fx_graph": {"hit": hit, "miss": miss, "bypass": 0}}}


def test_first_step_is_step_1_and_steady_is_the_median_step_from_step_3():
    records = [{"step": s, "elapsed_s": t} for s, t in [(1, 10.0), (2, 11.0), (3, 11.1), (4, 11.3), (5, 11.4)]]
    first, steady = compile_study.step_times([*records, {"step": 5, "val_loss": 1.0}])
    assert first == 10.0 and steady == pytest.approx(0.1)  # deltas 0.1, 0.2, 0.1 (step 2's 1.0 left out)


def test_a_compiled_run_folder_gives_every_measurement(tmp_path):
    write_run(tmp_path / "run", [5.0, 5.5, 5.52, 5.54, 5.58], memory=(1.0, 1.5, 1.25), report=report())
    row = compile_study.read_run(tmp_path / "run")
    assert row == {"first_step_s": 5.0, "steady_step_s": pytest.approx(0.02), "peak_memory_gib": 1.5,
                   "compile_time_s": 12.5, "graph_breaks": 1, "recompiles": 2,
                   "fx_graph_cache": {"hit": 0, "miss": 4}}


def test_an_eager_run_folder_has_no_compile_fields_and_a_missing_one_is_an_error(tmp_path):
    write_run(tmp_path / "eager", [0.5, 0.6, 0.7, 0.8])
    row = compile_study.read_run(tmp_path / "eager")
    assert row["first_step_s"] == 0.5 and row["steady_step_s"] == pytest.approx(0.1)
    assert row["compile_time_s"] is row["graph_breaks"] is row["fx_graph_cache"] is None
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        compile_study.read_run(tmp_path / "missing")


def test_table_has_one_row_per_variant_with_speedups_against_eager(tmp_path):
    write_run(tmp_path / "eager", [0.5, 0.6, 0.7, 0.8])
    write_run(tmp_path / "compiled", [9.0, 9.05, 9.1, 9.15], memory=(0.75,), report=report(hit=2, miss=2))
    rows = compile_study.with_speedups([
        {"variant": "eager", "mode": None, "error": None, **compile_study.read_run(tmp_path / "eager")},
        {"variant": "compile default", "mode": "default", "error": None,
         **compile_study.read_run(tmp_path / "compiled")},
    ])
    assert [row["speedup"] for row in rows] == [pytest.approx(1.0), pytest.approx(2.0)]
    lines = compile_study.format_table(rows).splitlines()
    assert lines[0] == ("| variant | compile (s) | first step (s) | steady step (ms) | speedup | peak memory (GiB) "
                        "| graph breaks | recompiles | FX cache hit/miss |")
    assert lines[2] == "| eager | - | 0.50 | 100.0 | 1.00 | 0.50 | - | - | - |"
    assert lines[3] == "| compile default | 12.5 | 9.00 | 50.0 | 2.00 | 0.75 | 1 | 2 | 2/2 |"


def test_a_failed_variant_shows_its_error_line_in_its_row():
    rows = compile_study.with_speedups([
        {"variant": "eager", "mode": None, "error": None, "steady_step_s": 0.1},
        {"variant": "compile max-autotune-no-cudagraphs", "mode": "max-autotune-no-cudagraphs",
         "error": "compile.mode='max-autotune-no-cudagraphs' is an inductor option ..."},
    ])
    lines = compile_study.format_table(rows).splitlines()
    assert lines[0].endswith("| FX cache hit/miss | error |")
    assert lines[2] == "| eager | - | - | 100.0 | 1.00 | - | - | - | - |  |"  # no error
    assert lines[3] == ("| compile max-autotune-no-cudagraphs | - | - | - | - | - | - | - | - | "
                        "compile.mode='max-autotune-no-cudagraphs' is an inductor option ... |")


def test_last_error_line_prefers_the_trainers_error_line_over_later_output():
    log = "step 1/4 loss 6.2\nerror: training.seq_len=0 is invalid\nexiting\n\n"
    assert compile_study.last_error_line(log) == "training.seq_len=0 is invalid"
    assert compile_study.last_error_line("Traceback ...\n  File x\nRuntimeError: boom\n") == "RuntimeError: boom"
    assert compile_study.last_error_line("") == "no output"


def test_each_mode_is_a_variant_and_cache_adds_portable_and_warm_local_rows(tmp_path):
    variants = compile_study.plan_variants(["default", "max-autotune-no-cudagraphs"], True, False, tmp_path)
    assert [v.name for v in variants] == [
        "eager", "compile default", "compile default, portable cache", "compile default, local cache warm",
        "compile max-autotune-no-cudagraphs",
    ]
    eager, first, portable, warm, other = variants
    assert eager.overrides == ("--compile.enable", "false") and eager.mode is None
    portable_flags = ("--compile.cache", "true", "--compile.cache_dir", str(tmp_path / "portable_cache"))
    assert first.overrides == ("--compile.enable", "true", "--compile.mode", "default", *portable_flags)
    assert portable.overrides == first.overrides
    assert warm.overrides == ("--compile.enable", "true", "--compile.mode", "default")  # no portable cache
    # Cold compiles each get a fresh inductor cache; the warm row reuses the first compile's.
    assert len({eager.inductor_cache, first.inductor_cache, portable.inductor_cache, other.inductor_cache}) == 4
    assert warm.inductor_cache == first.inductor_cache
    assert len({v.run_dir for v in variants}) == len(variants)


def test_a_config_that_caches_gets_the_cache_switched_off_in_the_other_compile_variants(tmp_path):
    eager, compiled = compile_study.plan_variants(["default"], False, True, tmp_path)
    assert eager.overrides == ("--compile.enable", "false")
    assert compiled.overrides[-2:] == ("--compile.cache", "false")


def test_each_variant_runs_in_this_environment_with_its_own_inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/triton")
    monkeypatch.setenv("NGPU", "8")
    variant = compile_study.plan_variants(["default"], False, False, tmp_path)[1]
    env = compile_study.trainer_env(variant, 2)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(variant.inductor_cache) and "TRITON_CACHE_DIR" not in env
    assert env["NPROC"] == "2" and "NGPU" not in env and env["VIRTUAL_ENV"] == sys.prefix
    command = compile_study.trainer_command(variant, "debug_model", ["--training.seq_len", "32"], 6)
    assert command == ["./run_train.sh", "--config", "debug_model", "--training.seq_len", "32", "--training.steps",
                       "6", "--metrics.log_freq", "1", "--checkpoint.enable", "false", "--job.dump_folder",
                       str(variant.run_dir), "--compile.enable", "true", "--compile.mode", "default"]


@pytest.mark.parametrize("args, message", [
    (["--modes", "default,fast"], "error: --modes: unknown mode 'fast' (choose from default, reduce-overhead, "
     "max-autotune, max-autotune-no-cudagraphs)"),
    (["--modes", "max-autotune"], "error: --modes: max-autotune captures CUDA graphs and needs a CUDA device, this "
     "machine has none (use max-autotune-no-cudagraphs or default)"),
    (["--steps", "3"], "error: --steps must be at least 4: the steady step time is the median after the first two "
     "steps (got 3)"),
    (["--training.steps", "20"], "error: --training.steps is set by compile_study.py per variant (use --steps)"),
    (["--compile.no_enable"], "error: --compile.enable is set by compile_study.py per variant (use --modes)"),
    (["--model.nope", "1"], "error: unknown key model.nope"),
    (["--repeats", "0"], "error: --nproc and --repeats must be >= 1 and --timeout > 0 (got 1, 0 and 3600"),
])
def test_bad_arguments_get_one_line_and_exit_code_2(args, message, capsys):
    if "CUDA" in message and torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    assert compile_study.main(["--config", "debug_model", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(message), err


def _row(variant, mode, compile_s, steady_s, error=None):
    return {"variant": variant, "mode": mode, "error": error, "compile_time_s": compile_s, "first_step_s": 1.0,
            "steady_step_s": steady_s, "peak_memory_gib": 0.5, "graph_breaks": 0, "recompiles": 0,
            "fx_graph_cache": None}


def test_rounds_combine_into_medians_with_their_ranges():
    rounds = [[_row("eager", None, None, s), _row("compile default", "default", c, s / 2)]
              for c, s in ((10.0, 0.30), (14.0, 0.20), (11.0, 0.22))]
    eager, compiled = compile_study.with_speedups(compile_study.combine_rounds(rounds))
    assert eager["steady_step_s"] == pytest.approx(0.22) and eager["spread"]["steady_step_s"] == (0.20, 0.30)
    assert compiled["compile_time_s"] == 11.0 and compiled["spread"]["compile_time_s"] == (10.0, 14.0)
    assert compiled["speedup"] == pytest.approx(2.0)
    row = compile_study.format_table([eager, compiled]).splitlines()[3]
    assert row.startswith("| compile default | 11.0 (10.0–14.0) | 1.00 | 110.0 (100.0–150.0) | 2.00 |"), row


def test_a_variant_that_failed_in_one_round_shows_that_error():
    rounds = [[_row("eager", None, None, 0.2), _row("compile default", "default", 10.0, 0.1)],
              [_row("eager", None, None, 0.2), _row("compile default", "default", None, None, error="boom")]]
    eager, compiled = compile_study.combine_rounds(rounds)
    assert compiled["error"] == "boom" and eager["error"] is None


def test_a_busy_machine_is_named_and_a_quiet_one_is_not():
    assert compile_study.busy_machine_warning(0.9, 2) is None
    warning = compile_study.busy_machine_warning(3.4, 2)
    assert warning.startswith("warning: the machine is busy (load average 3.4 on 2 cores)")
    assert "--repeats 3" in warning and "\n" not in warning


@pytest.mark.slow
def test_a_real_study_times_eager_and_compile_in_one_table(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, "scripts/compile_study.py", "--config", "debug_model", "--steps", "4", "--modes", "default",
         "--json", str(out), *TINY_MODEL],
        cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    eager, compiled = json.loads(out.read_text())
    assert (eager["variant"], compiled["variant"]) == ("eager", "compile default")
    for row in (eager, compiled):
        assert row["error"] is None and row["first_step_s"] > 0 and row["steady_step_s"] > 0, row
        assert row["peak_memory_gib"] > 0 and row["speedup"] > 0
    assert eager["compile_time_s"] is None and compiled["compile_time_s"] > 0
    assert compiled["graph_breaks"] == 0 and compiled["recompiles"] == 0
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 4 and table[2].startswith("| eager | - |") and table[3].startswith("| compile default |")
