"""Which chat template a run renders with (training.chat.chat_template): the tokenizer's own (tokenizer_config.json's
`chat_template` or the chat_template.jinja beside it), the plain one, a bundled one or a .jinja file; a model's own
template without `{% generation %}` blocks takes its assistant spans from the bundled template that writes the same
text (bundled_templates.py)."""

from __future__ import annotations

import logging
import os
from typing import Any

from dtrain.data.chat_template import PLAIN, ChatTemplate, JinjaChatTemplate, PlainChatTemplate
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError

logger = logging.getLogger("dtrain")


def _template_source(folder: str, config: dict[str, Any], config_file: str) -> tuple[str, str] | None:
    """(template text, where it came from) of a tokenizer folder, or None when it has none. chat_template.jinja
    wins over tokenizer_config.json's chat_template, as in transformers; a list of named templates gives its
    "default"."""
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
        if template is None:
            raise DataError(f"{config_file} lists chat templates {', '.join(map(str, named))} but no 'default' one")
    if template is None:
        return None
    if not isinstance(template, str):
        raise DataError(f"{config_file} chat_template must be a string, got {type(template).__name__}")
    return template, f"{config_file} chat_template"


def known_templates() -> str:
    """What training.chat.chat_template takes, for errors."""
    from dtrain.data.bundled_templates import bundled_names

    return (f"empty (the tokenizer's own), {PLAIN}, a bundled name ({', '.join(bundled_names())}) or a .jinja file")


def build_chat_template(tokenizer: Tokenizer, chat_template: str = "") -> ChatTemplate:
    """The template `training.chat.chat_template` asks for: "" the tokenizer's own (plain when it has none),
    "plain", a bundled template's name or a .jinja file (both need a Hugging Face tokenizer). A template of the
    tokenizer's own without {% generation %} blocks takes the assistant's spans from a bundled template that writes
    the same (bundled_templates.py). Says which in one log line."""
    from dtrain.data.bundled_templates import bundled_file
    from dtrain.data.hf_tokenizer import SPECIAL_TOKEN_KEYS, read_tokenizer_config, token_content

    if chat_template == PLAIN:
        logger.info("chat data: the plain template (training.chat.chat_template = plain)")
        return PlainChatTemplate(tokenizer)
    if tokenizer.kind != "hf":
        if chat_template:
            raise DataError(
                f"training.chat.chat_template {chat_template!r} needs the model's Hugging Face tokenizer (its "
                f"special tokens' ids), and model.tokenizer is {tokenizer.kind}: set model.hf_assets_path to the "
                "folder of its tokenizer.json (scripts/download_hf_assets.py --assets tokenizer fetches it) and leave "
                f"chat_template empty for the template it ships; chat_template takes {known_templates()}"
            )
        logger.info("chat data: the plain template (the %s tokenizer has no chat template)", tokenizer.kind)
        return PlainChatTemplate(tokenizer)
    config_file, config = read_tokenizer_config(tokenizer.path)
    if chat_template:
        path = bundled_file(chat_template) or chat_template
        if not os.path.isfile(path):
            raise DataError(f"training.chat.chat_template {chat_template!r} is neither a file nor a template dtrain "
                            f"knows; it takes {known_templates()}")
        with open(path, encoding="utf-8") as f:
            found: tuple[str, str] | None = (f.read(), path)
    else:
        found = _template_source(os.path.dirname(tokenizer.path), config, config_file)
    if found is None:
        logger.info("chat data: the plain template (%s has no chat_template)", config_file)
        return PlainChatTemplate(tokenizer)
    variables = {}
    for key in SPECIAL_TOKEN_KEYS:
        content = token_content(config.get(key), f"{config_file} {key}")
        if content is not None:
            variables[key] = content
    decoder = config.get("added_tokens_decoder") or {}
    special = [entry.get("content") for entry in decoder.values() if isinstance(entry, dict) and entry.get("special")]

    def template(source: str, origin: str) -> JinjaChatTemplate:
        return JinjaChatTemplate(source, origin, tokenizer, variables, [*special, *variables.values()])

    chosen = template(*found)
    if not chosen.marks_generation:
        marked = _bundled_alike(chosen, template)
        if marked is not None:
            chosen.use_marked(marked)
    logger.info("chat data: %s", chosen.description)
    return chosen


def _bundled_alike(model: JinjaChatTemplate, template: Any) -> JinjaChatTemplate | None:
    """The bundled template that writes what `model` writes (bundled_templates.py), if one does."""
    from dtrain.data.bundled_templates import bundled_file, bundled_names, renders_alike

    for name in bundled_names():
        path = bundled_file(name)
        with open(path, encoding="utf-8") as f:
            bundled = template(f.read(), path)
        if renders_alike(model, bundled):
            return bundled
    return None
