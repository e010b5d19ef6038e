"""run_generate.sh as a user runs it: greedy generation from a Hugging Face folder equals transformers'
``generate(do_sample=False)`` token for token (Llama and Qwen3, random models transformers builds here), a trained
dtrain checkpoint generates text, and mistakes get one line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from dtrain.generate import main as generate_main
from tests.e2e.run_train_helpers import REPO, TINY, run_train, user_env

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
             # Wide initial weights: a random model at the usual 0.02 repeats one token, which tests little.
             initializer_range=0.5)
FAMILIES = {
    "llama3": lambda tie: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tie)),
    "qwen3": lambda tie: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**SHAPE, head_dim=24, tie_word_embeddings=tie)
    ),
}
PROMPT = [5, 17, 33, 9, 64]


def ids_line(stdout: str) -> list[int]:
    line = next(line for line in stdout.splitlines() if line.startswith("ids: "))
    return [int(i) for i in line.removeprefix("ids: ").split(",")]


@pytest.mark.parametrize("family, tie", [("llama3", False), ("qwen3", True), ("qwen3", False)])
def test_greedy_generation_equals_transformers(tmp_path, capsys, family, tie):
    torch.manual_seed(14)
    theirs = FAMILIES[family](tie).eval()
    theirs.save_pretrained(tmp_path)
    expected = theirs.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=24)[0, len(PROMPT):].tolist()
    code = generate_main(["--checkpoint", str(tmp_path), "--hf", "--prompt_ids", ",".join(map(str, PROMPT)),
                          "--max_new_tokens", "24", "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert ids_line(out.out) == expected
    assert len(set(expected)) > 3  # the model says something, not one token over and over
    assert "text:" not in out.out  # no tokenizer in the folder, so nothing to decode


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["./run_generate.sh", *args], cwd=REPO, env=user_env(), capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A trained run (8 steps) with one committed checkpoint, checkpoint/step-8."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    trained = run_train(*TINY, "--model.args.n_layers", "2", "--checkpoint.enable", "true",
                        "--checkpoint.interval", "8", "--job.dump_folder", str(run_dir))
    assert trained.returncode == 0, trained.stderr[-2000:]
    return run_dir


def test_a_trained_checkpoint_generates_text_and_samples_reproducibly(run_dir):
    # The run's checkpoint folder stands for its newest checkpoint; the run's config.toml gives the model.
    greedy = run_generate("--checkpoint", str(run_dir / "checkpoint"), "--prompt", "def ", "--max_new_tokens", "12")
    assert greedy.returncode == 0, greedy.stderr[-2000:]
    ids = ids_line(greedy.stdout)
    assert 1 <= len(ids) <= 12 and all(0 <= i < 258 for i in ids)
    assert any(line.startswith("text: ") for line in greedy.stdout.splitlines())
    assert "generate: llama3 on cpu (float32), 5 prompt tokens" in greedy.stderr  # BOS + the 4 bytes of "def "
    sampled = [
        run_generate("--checkpoint", str(run_dir / "checkpoint" / "step-8"), "--prompt_ids", "256,100,101",
                     "--max_new_tokens", "12", "--temperature", "1.5", "--top_k", "50", "--seed", str(seed),
                     "--ignore_eos")
        for seed in (1, 1, 2)
    ]
    assert all(r.returncode == 0 for r in sampled), sampled[0].stderr[-2000:]
    first, again, other = (ids_line(r.stdout) for r in sampled)
    assert first == again != other and len(first) == 12


def test_a_run_folder_names_its_newest_checkpoint_and_a_partial_one_is_refused(run_dir, tmp_path, capsys):
    step = run_dir / "checkpoint" / "step-8"
    args = ["--prompt_ids", "256,100,101", "--max_new_tokens", "6", "--device", "cpu"]
    generated = []
    for named in (step, run_dir / "checkpoint", run_dir):
        code = generate_main(["--checkpoint", str(named), *args])
        out = capsys.readouterr()
        assert code == 0, out.err
        generated.append(ids_line(out.out))
    assert generated[0] == generated[1] == generated[2]
    # The model's vocabulary is the byte tokenizer's 258 rounded up to a multiple of 64: its padding rows are never
    # chosen, even by near-uniform sampling (which would pick one of them about every fifth token).
    assert generate_main(["--checkpoint", str(run_dir), "--prompt_ids", "256", "--max_new_tokens", "48",
                          "--temperature", "1000", "--ignore_eos", "--device", "cpu"]) == 0
    hot = ids_line(capsys.readouterr().out)
    assert len(hot) == 48 and max(hot) < 258
    # A save that never committed (in a copy of the run): refused even when every file and a record are there.
    checkpoints = shutil.copytree(run_dir, tmp_path / "run") / "checkpoint"
    partial = checkpoints / "step-16.partial"
    shutil.copytree(step, partial)
    assert generate_main(["--checkpoint", str(partial), *args]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --checkpoint {partial} is uncommitted (a save that never finished) and is never loaded; "
        f"the latest committed one is {checkpoints / 'step-8'}"
    ]
    deleting = shutil.copytree(step, checkpoints / "step-4.deleting")  # a pruning that a kill cut short
    assert generate_main(["--checkpoint", str(deleting), *args]) != 0
    assert "is uncommitted (a checkpoint being deleted by keep_latest_k)" in capsys.readouterr().err
    shutil.rmtree(deleting)
    shutil.rmtree(checkpoints / "step-8")
    for named, message in [(partial, "uncommitted (a save that never finished) and is never loaded; none beside"),
                           (checkpoints, "with committed ones (only uncommitted step-16.partial)")]:
        assert generate_main(["--checkpoint", str(named), *args]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_a_checkpoint_from_elsewhere_loads_unverified_with_one_warning(run_dir, tmp_path, capsys):
    # A DCP folder without dtrain's commit record (torchtitan's, a bare DCP save): its files carry no checksums.
    foreign = shutil.copytree(run_dir / "checkpoint" / "step-8", tmp_path / "foreign")
    (foreign / "dtrain_commit.json").unlink()
    args = ["--config", str(run_dir / "config.toml"), "--prompt_ids", "256,100", "--max_new_tokens", "4"]
    assert generate_main(["--checkpoint", str(foreign), *args, "--device", "cpu"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: {foreign} has no dtrain_commit.json: a checkpoint from elsewhere, read without checksums"
    ]


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi"], "--prompt needs a tokenizer and"),
    (["--prompt_ids", "1,x"], "--prompt_ids '1,x' is not a comma-separated list of integers"),
    (["--prompt_ids", "1,500"], "--prompt_ids has 500, outside this model's vocabulary 0..127"),
    (["--prompt_ids", "1", "--max_new_tokens", "5000"], "exceed the model's max_seq_len"),
    (["--prompt_ids", "1", "--top_p", "2"], r"--top_p must be in (0, 1]"),
    (["--prompt_ids", "1", "--top_p", "nan"], r"--top_p must be in (0, 1]"),
    (["--prompt_ids", "1", "--temperature", "nan"], "--temperature must be 0 (greedy) or a finite number >= 1.18e-38"),
    (["--prompt_ids", "1", "--temperature", "1e-40"], "--temperature must be 0 (greedy) or a finite number >="),
    (["--prompt_ids", "1", "--model.args.dim", "32"], "model.args.dim=32 contradicts"),
])
def test_mistakes_get_one_line(tmp_path, capsys, args, message):
    FAMILIES["llama3"](False).save_pretrained(tmp_path)
    capsys.readouterr()  # transformers' progress bar
    code = generate_main(["--checkpoint", str(tmp_path), "--hf", "--device", "cpu", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_missing_checkpoint_is_named(tmp_path, capsys):
    assert generate_main(["--checkpoint", str(tmp_path / "nope"), "--prompt_ids", "1"]) != 0
    assert capsys.readouterr().err.strip() == f"error: --checkpoint {tmp_path / 'nope'} does not exist"
