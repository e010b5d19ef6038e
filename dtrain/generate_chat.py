"""`run_generate.sh --chat`: a conversation with the model, in the chat template its training used.

    ./run_generate.sh --checkpoint outputs/chat_lora --chat --system "You are a calculator."
    echo "What is 2 + 3?" | ./run_generate.sh --checkpoint /models/Qwen3-0.6B --hf --chat --max_new_tokens 64

Each stdin line is a user turn (EOF ends the conversation; `--prompt` gives a single turn instead). The
conversation so far is rendered with the generation prompt, as `apply_chat_template(..., add_generation_prompt=True)`
renders it, the answer is streamed to stdout as its tokens come (a flush per decoded piece), ends with a newline,
and joins the conversation as the assistant's turn. The template is the one training builds
(dtrain/data/chat_template.py): `training.chat.chat_template` of the run's config (or of `--training.chat.*`
flags), else the tokenizer's own; a run trained on chat data with a tokenizer without one used the plain template,
and so does its chat. Greedy answers equal transformers' `generate` on the same ids (tests/e2e/test_generate_chat.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

import torch

from dtrain.errors import ConfigError


def check_prompt_options(opts: argparse.Namespace) -> None:
    """One of --prompt, --prompt_ids and --chat; --system only with --chat. Before the model loads."""
    if opts.chat and opts.prompt_ids is not None:
        raise ConfigError("--chat renders the conversation into ids with the chat template, so --prompt_ids cannot "
                          "go with it: give the user's turns on stdin (or one with --prompt)")
    if not opts.chat and opts.system is not None:
        raise ConfigError("--system is the system prompt of a conversation: add --chat")
    if not opts.chat and opts.prompt is None and opts.prompt_ids is None:
        raise ConfigError("nothing to continue: give --prompt TEXT, --prompt_ids IDS, or --chat (turns on stdin)")


def chat_template(opts: argparse.Namespace, loaded) -> object:
    """The template the run trained with (see the module doc); a tokenizer without one is one line, naming the key
    that sets one, unless the run trained on chat data with the plain template."""
    from dtrain.data.chat_template import PlainChatTemplate
    from dtrain.data.chat_template_choice import build_chat_template, known_templates

    if loaded.tokenizer is None:
        raise ConfigError(f"--chat needs a tokenizer and {opts.checkpoint} has none; pass --model.hf_assets_path "
                          "with a tokenizer folder")
    config = loaded.config
    chosen = config.training.chat.chat_template
    template = build_chat_template(loaded.tokenizer, chosen)
    trained_plain = not opts.hf and config.training.dataset == "chat"
    if isinstance(template, PlainChatTemplate) and not chosen and not trained_plain:
        raise ConfigError(
            f"--chat: the {loaded.tokenizer.kind} tokenizer of {opts.checkpoint} has no chat template (a Hugging Face "
            "tokenizer's is tokenizer_config.json's chat_template or chat_template.jinja) and no chat training chose "
            f"one; set one with --training.chat.chat_template, which takes {known_templates()}"
        )
    return template


def _turns(opts: argparse.Namespace) -> Iterator[str]:
    if opts.prompt is not None:
        yield opts.prompt
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


class Streamer:
    """Prints an answer's text as its tokens come: each time the decoded text grows by whole characters (a
    character split over tokens waits for its last byte), the new part, flushed."""

    def __init__(self, tokenizer, eos_ids: tuple[int, ...]):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.ids: list[int] = []
        self.text = ""

    def __call__(self, token: torch.Tensor) -> None:
        token_id = int(token[0])
        if token_id in self.eos_ids:
            return
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return
        print(text[len(self.text):], end="", flush=True)
        self.text = text

    def finish(self) -> str:
        """The whole answer, its rest printed and the line ended."""
        text = self.tokenizer.decode(self.ids)
        print(text[len(self.text):] if text.startswith(self.text) else "", flush=True)
        return text


def chat(opts: argparse.Namespace, loaded, sampling, device: torch.device) -> int:
    from dtrain.models.decoding import generate

    template = chat_template(opts, loaded)
    print(f"chat: {template.description}; {loaded.family} on {device}", file=sys.stderr)
    messages = [{"role": "system", "content": opts.system}] if opts.system else []
    generator = torch.Generator(device).manual_seed(opts.seed)
    for turn in _turns(opts):
        messages.append({"role": "user", "content": turn})
        ids = template.generation_prompt(messages)
        if len(ids) + opts.max_new_tokens - 1 > loaded.max_seq_len:
            raise ConfigError(
                f"the conversation ({len(ids)} tokens) + --max_new_tokens {opts.max_new_tokens} exceed the model's "
                f"max_seq_len {loaded.max_seq_len} (raise it with --model.args.max_seq_len, or start a new chat)"
            )
        streamer = Streamer(loaded.tokenizer, loaded.eos_ids)
        began = time.perf_counter()
        new = generate(loaded.model, torch.tensor([ids], device=device), opts.max_new_tokens, sampling,
                       loaded.eos_ids, generator, loaded.tokenizer.vocab_size, on_token=streamer)
        answer = streamer.finish()
        seconds = time.perf_counter() - began
        print(f"chat: {len(ids)} prompt tokens, {new.shape[1]} new in {seconds:.2f} s", file=sys.stderr)
        messages.append({"role": "assistant", "content": answer})
    return 0
