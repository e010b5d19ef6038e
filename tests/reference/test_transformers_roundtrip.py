"""Hugging Face round trips against transformers' own code, per family (Llama 3 with `llama3` RoPE scaling, Qwen3,
Qwen3-MoE, DeepSeek-V3 with YaRN and a low-rank query), as a user runs them:

transformers builds a tiny random model and saves it (safetensors) -> ./run_train.sh starts a run from that folder
at lr 0 and saves its last checkpoint -> scripts/convert_checkpoint.py to-hf with the run's config.toml ->
transformers loads the export: the same logits as the original, and the same config (RoPE scaling, special
tokens); greedy ./run_generate.sh on the run's own checkpoint gives transformers' greedy ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_train_helpers import FP32, REPO, run_train, user_env

from dtrain.data import ByteTokenizer

transformers = pytest.importorskip("transformers")

# The byte tokenizer's BOS and EOS (dtrain/data/tokenizer.py), so that both sides stop generating at the same id.
BOS, EOS = 256, 257
COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320, max_position_embeddings=64,
              bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
              # Wide initial weights: a random model at the usual 0.02 repeats one token, which tests little.
              initializer_range=0.5)
# With head_dim 16 and an original length of 32, Llama's scaling keeps, interpolates and slows frequencies alike.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
# YaRN with both mscales set and unequal (the table factor and the softmax scale both differ from 1).
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.8}
CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON, intermediate_size=160, num_key_value_heads=2, rope_theta=10000.0, rope_scaling=LLAMA3_SCALING),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, intermediate_size=160, num_key_value_heads=2, head_dim=24),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=160, num_key_value_heads=2, head_dim=24, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON, intermediate_size=128, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, rope_theta=10000.0, rope_scaling=YARN),
}
# What dtrain's runs of each family must add: DeepSeek-V3's routing bias moves after every optimizer step whatever
# the lr (loss-free balancing), so an lr-0 run keeps its weights only with that speed at 0.
RUN_FLAGS = {"deepseek_v3": ["--model.args.moe_bias_update_speed", "0"]}
IDS = torch.tensor([[BOS, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 3, 200, 150, 99, 7]])
PROMPT = [BOS, 68, 101, 102, 32]


def original_model(family: str, folder: Path):
    """transformers' random model of `family`, saved to `folder`; its norms and routing biases off their init
    values (ones, zeros), so that a misplaced one shows in the logits."""
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "layernorm.weight")):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.05, 0.05)
    model.save_pretrained(folder)
    return model


def tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=180)


def rope_of(model) -> dict:
    """RoPE settings as transformers reads them (rope_parameters from v5 on, rope_theta and rope_scaling before),
    less the legacy spelling of the type."""
    config = model.config
    rope = {"rope_theta": getattr(config, "rope_theta", None), **(getattr(config, "rope_scaling", None) or {}),
            **(getattr(config, "rope_parameters", None) or {})}
    return {key: value for key, value in rope.items() if key != "type"}


@pytest.mark.slow
@pytest.mark.parametrize("family", CONFIGS)
def test_hf_folder_trains_exports_and_generates_as_transformers(tmp_path, family):
    hf, run_dir, out = tmp_path / "hf", tmp_path / "run", tmp_path / "exported"
    original = original_model(family, hf)
    trained = run_train(
        "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf", "--optimizer.lr", "0",
        "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--checkpoint.enable", "--checkpoint.export_dtype", "float32", *FP32, "--job.dump_folder", str(run_dir),
        *RUN_FLAGS.get(family, []),
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    written = (run_dir / "config.toml").read_text()
    # The run names no flavor: its [model.args] hold the whole shape, RoPE scaling included.
    assert 'flavor = ""' in written and "rope_theta = " in written
    if family == "deepseek_v3":  # config.json's numerics, not torchtitan's flavors' (so to-hf may export them)
        assert all(line in written for line in ("latent_norm_eps = 1e-06", "final_norm_dtype_eps = false",
                                                "rope_scaling_beyond_original_only = false"))

    checkpoint = run_dir / "checkpoint" / "step-2"
    converted = tool(sys.executable, "scripts/convert_checkpoint.py", "to-hf", str(checkpoint), str(out),
                     "--config", str(run_dir / "config.toml"), "--dtype", "float32")
    assert converted.returncode == 0, converted.stderr[-3000:]
    exported = json.loads((out / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (BOS, EOS)
    assert exported["architectures"] == json.loads((hf / "config.json").read_text())["architectures"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert rope_of(reloaded) == rope_of(original)
    if family == "deepseek_v3":
        assert reloaded.config.q_lora_rank == 24
    with torch.no_grad():
        expected, got = original(IDS).logits, reloaded(IDS).logits
    assert (got - expected).abs().max().item() <= 1e-5

    generated = tool("./run_generate.sh", "--checkpoint", str(run_dir / "checkpoint"),
                     "--prompt_ids", ",".join(map(str, PROMPT)), "--max_new_tokens", "12")
    assert generated.returncode == 0, generated.stderr[-3000:]
    ids = next(line for line in generated.stdout.splitlines() if line.startswith("ids: "))
    # The run decodes with its byte tokenizer, whose ids end below the model's vocabulary: generation never picks the
    # rows past them, so transformers is told to suppress the same ones.
    padding = list(range(ByteTokenizer().vocab_size, original.config.vocab_size))
    with torch.no_grad():
        greedy = original.generate(
            torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12, suppress_tokens=padding
        )[0, len(PROMPT):]
    assert [int(i) for i in ids.removeprefix("ids: ").split(",")] == greedy.tolist()
    assert len(set(greedy.tolist())) > 2  # the model says something, not one token over and over
