"""End to end through ./run_train.sh: train_configs/debug_chat.toml fine-tunes the debug model on the bundled
arithmetic chats (byte tokenizer, plain template, packed, block-causal); the loss falls, only the assistant tokens
are trained, and validation on the held-out chats logs val_loss and val_perplexity."""

import json
import math
import re

import pytest
from run_train_helpers import FP32, REPO, read_metrics, run_train

pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]

BUNDLED = REPO / "dtrain" / "data" / "assets" / "chat_arithmetic.jsonl"

SHORT = ["--training.steps", "10", "--training.seq_len", "128", "--training.local_batch_size", "4",
         "--validation.freq", "5", "--validation.seq_len", "128", "--metrics.log_freq", "1"]


def test_debug_chat_config_fine_tunes_on_assistant_tokens(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("--job.config_file", "train_configs/debug_chat.toml", *SHORT, *FP32,
                       "--job.dump_folder", str(run_dir))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "chat data: the plain template (the byte tokenizer has no chat template)" in output
    # The pass line counts the tokens that are labels, from the targets the batches are made of.
    counts = re.search(r"chat data, pass 0 over chat file .*chat_arithmetic.jsonl.*: 48 conversations, (\d+) dropped "
                       r".*; (\d+) of their (\d+) tokens are trained", output)
    assert counts, output[-3000:]
    # Exactly the answers' bytes and one EOS after each, of the conversations that fit seq_len + 1 = 129 tokens
    # (the byte tokenizer: one token per byte; the plain template: BOS, "Role: text\n", "Assistant: " answer EOS).
    trained = total = 0
    for row in BUNDLED.read_text().splitlines():
        messages = json.loads(row)["messages"]
        answers = [len(m["content"].encode()) + 1 for m in messages if m["role"] == "assistant"]
        others = [len(f"{m['role'].capitalize()}: {m['content']}\n".encode()) for m in messages
                  if m["role"] != "assistant"]
        length = 1 + sum(others) + sum(answers) + len(answers) * len("Assistant: ")
        if length <= 129:
            trained, total = trained + sum(answers), total + length
    assert (int(counts[2]), int(counts[3])) == (trained, total)

    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0]
    records = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert [r["step"] for r in records] == [5, 10]
    assert all(r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"])) for r in records)
    assert "the bundled held-out chat file, which training never reads" in output
    # A fine-tuning config saves its last step: generation and export have something to read.
    assert (run_dir / "checkpoint" / "step-10").is_dir() and "no checkpoint saved" not in output


def test_a_row_without_an_answer_is_one_line_before_the_run_starts(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2 + 2?"}]}) + "\n")
    run_dir = tmp_path / "run"
    result = run_train("--job.config_file", "train_configs/debug_chat.toml", "--training.dataset_path", str(data),
                       "--job.dump_folder", str(run_dir))
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"error: {data} line 1 has no assistant turn: there is nothing " \
                                                    "to train on; every row needs an answer"
    assert not (run_dir / "config.toml").exists()
