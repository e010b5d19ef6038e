"""A tiny Llama built by transformers with random weights and a Llama-3-style tokenizer (BOS added by its
post-processor, as Meta's is), saved as a Hugging Face folder; and the harness's `hf` backend over it."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Nothing downloads in these tests: the harness and datasets must find everything on disk.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

MAX_LENGTH = 128  # the model's context: short enough that the rolling task's documents need several windows
TEXTS = [
    "Question: The sky on a clear day is\nAnswer: blue green loud four seven fish ice steam sand meow moo quack",
    "Q: 2+3=\nA: 5 Q: 1+1=\nA: 2 numbers go one, two, three, four, five, six, seven, eight, nine, ten.",
    "The quick brown fox jumps over the lazy dog. Once upon a time there was a small model that learned to count.",
]


def write_tiny_llama(folder: Path) -> Path:
    """transformers' LlamaForCausalLM of a few thousand parameters, random (seeded), fp32, with its tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1],
        "model_max_length": MAX_LENGTH,
    }))
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=MAX_LENGTH, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: greedy answers then differ between prompts
        for param in model.parameters():
            param.mul_(4.0)
    model.save_pretrained(folder)
    return folder


def hf_backend(folder: Path, batch_size: int):
    """The harness's own `hf` backend over `folder`, in fp32 on the CPU, with the same context."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=batch_size,
                max_length=MAX_LENGTH, attn_implementation="eager")
