"""The same preference run in TRL and in dtrain: a tiny transformers Llama with random weights and a Llama 3 style
tokenizer written to a folder, trained on the same pairs in the same order with AdamW at a constant rate and
gradient clipping at 1.0, fp32 on the CPU. TRL's trainers log each step's loss and metrics; dtrain's go to its
metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from chat_tokenizers import write_chat_tokenizer

REPO = Path(__file__).resolve().parents[2]
STEPS, PAIRS_PER_STEP, LR, SEQ_LEN = 4, 2, 1e-3, 96
QUESTIONS = [("What is 2 + 3?", "2 + 3 = 5.", "2 + 3 = 6."), ("What is 7 * 6?", "7 * 6 = 42.", "It is 48."),
             ("Name a colour.", "Blue.", "A cat."), ("What is 10 - 4?", "10 - 4 = 6.", "10 - 4 = 5, I think."),
             ("Say hello.", "Hello!", "Goodbye."), ("What is 9 + 9?", "18.", "9 + 9 = 19."),
             ("Is ice cold?", "Yes, ice is cold.", "No."), ("What is 3 * 3?", "3 * 3 = 9.", "3 * 3 = 6.")]


def pairs() -> list[dict]:
    """Explicit-prompt conversational pairs, one of them after a first exchange (a multi-turn prompt)."""
    rows = []
    for index, (question, good, bad) in enumerate(QUESTIONS):
        prompt = [{"role": "user", "content": question}]
        if index == 3:
            prompt = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}, *prompt]
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": good}],
                     "rejected": [{"role": "assistant", "content": bad}]})
    return rows


def write_model(folder: Path) -> Path:
    """A random-weight LlamaForCausalLM (2 layers, GQA) and its tokenizer, saved as transformers saves them."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    write_chat_tokenizer(folder, "llama3", "plain")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def write_pairs(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in pairs()))
    return path


def trl_run(model_folder: Path, out: Path, loss: str, **settings) -> list[dict]:
    """TRL's DPOTrainer (sigmoid, ipo; the reference passed as ref_model) or CPOTrainer (simpo): per step, the
    loss its compute_loss returned and the metrics it logged."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = dict(
        output_dir=str(out), per_device_train_batch_size=PAIRS_PER_STEP, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=1.0, logging_steps=1, bf16=False, use_cpu=True, report_to=[], save_strategy="no",
        train_sampling_strategy="sequential", seed=0, **settings,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    tokenizer.pad_token = tokenizer.eos_token  # what DPOTrainer does itself, and CPOTrainer asks for
    policy = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    dataset = Dataset.from_list(pairs())
    if loss == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(loss_type="simpo", cpo_alpha=0.0, max_length=SEQ_LEN + 1, **common)
        trainer_class, extra = CPOTrainer, {}
    else:
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(loss_type=[loss], **common)
        reference = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
        trainer_class, extra = DPOTrainer, {"ref_model": reference}
    losses: list[float] = []

    class Recording(trainer_class):
        def compute_loss(self, *args, **kwargs):
            value = super().compute_loss(*args, **kwargs)
            losses.append((value[0] if isinstance(value, tuple) else value).item())
            return value

    trainer = Recording(model=policy, args=args, train_dataset=dataset, processing_class=tokenizer, **extra)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "rewards/chosen" in entry]
    return [{**entry, "loss": value} for entry, value in zip(logged, losses, strict=True)]


def dtrain_run(model_folder: Path, data: Path, out: Path, loss: str, *flags: str) -> list[dict]:
    """dtrain started from the same folder on the same pairs: each step's metrics."""
    argv = [
        "--training.dataset", "preference", "--training.dataset_path", str(data),
        "--training.preference.loss", loss, "--model.hf_assets_path", str(model_folder),
        "--checkpoint.initial_load_path", str(model_folder), "--checkpoint.initial_load_in_hf",
        "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(PAIRS_PER_STEP),
        "--training.steps", str(STEPS), "--training.mixed_precision_param", "float32", "--training.max_norm", "1.0",
        "--optimizer.name", "AdamW", "--optimizer.lr", str(LR), "--optimizer.beta2", "0.999",
        "--optimizer.weight_decay", "0", "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0",
        "--metrics.log_freq", "1", "--job.dump_folder", str(out), *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "dtrain.main", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
