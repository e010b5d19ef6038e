"""[training.chat]: how chat data (conversations, prompt/completion rows) is read, rendered and trained."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config.options import opt


@dataclass
class Chat:
    chat_template: str = opt(
        "",
        "The chat template: empty = the tokenizer's own (tokenizer_config.json's chat_template or "
        "chat_template.jinja, rendered as transformers does), plain when it has none; plain; or a .jinja file.",
    )
    train_on_input: bool = opt(False, "Train on every token, not only the assistant's answers.")
    packed: bool = opt(
        True,
        "Pack several whole conversations per sequence (each its own document under "
        "attention_mask = block_causal); false: one conversation per sequence, padded (padding is not trained).",
    )
    overlong_policy: str = opt(
        "drop",
        "A conversation longer than seq_len + 1 tokens is dropped, or truncated to it; the counts "
        "are logged once per pass.",
        choices=("drop", "truncate"),
    )
    messages_field: str = opt("messages", "The field of a row holding its list of messages.")
    role_field: str = opt("role", "The field of a message holding its role (ShareGPT: from).")
    content_field: str = opt("content", "The field of a message holding its text (ShareGPT: value).")
    prompt_field: str = opt("prompt", "A prompt/completion row's prompt field (text or messages).")
    completion_field: str = opt("completion", "A prompt/completion row's completion field.")
    streaming: bool = opt(False, "Read dataset_path's data files with datasets' load_dataset(streaming=True).")
    validation_fraction: float = opt(
        0.05,
        "With [validation] on chat data and no validation.dataset_path, this fraction of training.dataset_path's "
        "conversations (chosen by position: the same every run) is held out for validation and never trained on; "
        "0 validates on the bundled held-out file.",
        minimum=0.0,
    )
