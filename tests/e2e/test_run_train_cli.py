"""End to end through ./run_train.sh on the debug config: training, outputs, determinism and error handling."""

import subprocess
import time

import pytest
from run_train_helpers import FP32, REPO, TINY, read_metrics, run_train, user_env

pytestmark = pytest.mark.slow


def test_debug_model_trains_writes_outputs_and_is_deterministic(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    result = run_train(*TINY, "--job.dump_folder", str(first))
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_metrics(first)
    assert [r["step"] for r in records] == list(range(1, 9))
    for key in ("step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib"):
        assert key in records[0]
    assert records[0]["mfu"] is None  # no known peak for a CPU: no guess
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert list((first / "tb").glob("events.out.tfevents.*"))
    assert 'flavor = "debugmodel_gqa"' in (first / "config.toml").read_text()
    last = result.stderr.strip().splitlines()[-1]
    assert "training done: 8 steps" in last and "no checkpoint saved (checkpoint.enable = false)" in last

    assert run_train(*TINY, "--job.dump_folder", str(second)).returncode == 0
    assert [r["loss"] for r in read_metrics(second)] == [r["loss"] for r in records]


def test_gradient_accumulation_matches_one_big_microbatch(tmp_path):
    common = [*TINY, *FP32, "--training.steps", "3", "--training.global_batch_size", "4"]
    whole = run_train(*common, "--job.dump_folder", str(tmp_path / "whole"))
    split = run_train(*common, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path / "split"))
    assert whole.returncode == 0 and split.returncode == 0, split.stderr[-2000:]
    losses = [[r["loss"] for r in read_metrics(tmp_path / name)] for name in ("whole", "split")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_unknown_key_is_one_line_exit_2_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("--training.stepz", "3", "--job.dump_folder", str(run_dir))
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown key training.stepz (did you mean training.steps?)"
    assert "Traceback" not in result.stdout + result.stderr
    assert not run_dir.exists()


def test_missing_tokenizer_names_the_file_and_the_download_script(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("--config", "llama3_8b", "--job.dump_folder", str(run_dir))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Llama-3.1-8B" in lines[0] and "download_hf_assets.py" in lines[0]
    assert not run_dir.exists()


def test_a_model_too_big_for_the_machine_is_refused_in_one_line_before_allocation(tmp_path):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    # 405B with AdamW needs about 7 TiB per process: no test machine has that, and allocating it would take minutes.
    result = run_train("--model.flavor", "405B", "--job.dump_folder", str(run_dir))
    assert time.monotonic() - start < 30
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: estimated memory per rank "), result.stderr[-2000:]
    assert "params" in lines[0] and "optimizer" in lines[0] and "--training.skip_memory_check" in lines[0]
    assert not run_dir.exists()  # no config.toml, no metrics, no lock, not even the folder


def test_help_and_print_config_answer_without_training(tmp_path):
    run_dir = tmp_path / "run"
    shown = run_train("--help")
    assert shown.returncode == 0 and "--training.steps" in shown.stdout and "--debug.seed" in shown.stdout
    printed = run_train("--config", "debug_model.toml", "--training.steps", "7", "--job.print_config",
                        "--job.dump_folder", str(run_dir))
    assert printed.returncode == 0 and "steps = 7" in printed.stdout
    assert "print_config = false" in printed.stdout  # the printed config trains when passed back with --config
    assert not run_dir.exists()


def test_paths_are_those_of_the_directory_the_user_stands_in(tmp_path):
    """From outside the checkout, as with torchtitan: a config path and the dump folder (on the command line, and
    inside the TOML) are relative to the caller's directory; a bare config name still comes from train_configs/."""
    (tmp_path / "configs").mkdir()
    toml = (REPO / "train_configs" / "debug_model.toml").read_text()
    (tmp_path / "configs" / "mine.toml").write_text(toml.replace('"./outputs/debug_model"', '"./runs/from_toml"'))
    run = [str(REPO / "run_train.sh"), "--config", "configs/mine.toml", *TINY, "--training.steps", "1"]
    done = subprocess.run(run, cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "runs" / "from_toml" / "metrics.jsonl").is_file()
    printed = subprocess.run([str(REPO / "run_train.sh"), "--config", "qwen3_debug", "--job.print_config"],
                             cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0 and 'name = "qwen3"' in printed.stdout, printed.stderr
    assert not (REPO / "runs").exists()


def test_a_warning_while_preparing_the_run_carries_the_rank_tag_once(tmp_path):
    """prepare() warns before training starts (here: a tokenizer_config.json whose ids tokenizer.json lacks, as in
    torchtitan's test tokenizer); that line is tagged like every other, and the launch check does not repeat it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<|begin_of_text|>", "<|end_of_text|>", "[UNK]", *"abcdefghijklmnopqrstuvwxyz"]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    assets = tmp_path / "tokenizer"
    assets.mkdir()
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(
        '{"added_tokens_decoder": {"128000": {"content": "<|begin_of_text|>", "special": true}}}')
    result = run_train(*TINY, "--training.steps", "1", "--model.tokenizer", "auto", "--model.hf_assets_path",
                       str(assets), "--job.dump_folder", str(tmp_path / "run"), NPROC="2")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert all(line.startswith("[rank0]:20") for line in lines), result.stderr
    assert sum("declares ids that tokenizer.json does not have" in line for line in lines) == 1, result.stderr
