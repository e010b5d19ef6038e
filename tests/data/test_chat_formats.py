"""The chat formats people have, against transformers with real templates: a row's `tools`, OpenAI's tool calls
(a null content when a turn only calls) and tool results; the bundled {% generation %} templates that mark the
assistant's tokens of a model whose own template has no such blocks (ids: transformers' with the model's
template; trained tokens: transformers' assistant mask with the bundled one); and the names that
training.chat.chat_template takes."""

from __future__ import annotations

import json

import pytest

from dtrain.config.schema_chat import Chat
from dtrain.data import chat_template_choice
from dtrain.data.bundled_templates import bundled_file
from dtrain.data.chat_source import conversation, row_tools
from dtrain.data.chat_template_choice import build_chat_template
from dtrain.data.hf_tokenizer import HFTokenizer
from dtrain.data.tokenizer import ByteTokenizer
from dtrain.errors import DataError
from tests.data.chat_tokenizers import write_chat_tokenizer

transformers = pytest.importorskip("transformers")


def call(name, **arguments):
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# OpenAI's own format: a turn that only calls has a null content; results come back as `tool` turns.
TOOL_ROW = {"tools": TOOLS, "messages": [
    {"role": "system", "content": "You report the weather."},
    {"role": "user", "content": "What is the weather in Paris and Rome?"},
    {"role": "assistant", "content": None,
     "tool_calls": [call("get_weather", city="Paris"), call("get_weather", city="Rome")]},
    {"role": "tool", "tool_call_id": "call_get_weather", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_get_weather", "content": "rain, 14 C"},
    {"role": "assistant", "content": "Paris is sunny; Rome has rain."},
    {"role": "user", "content": "thank you"},
    {"role": "assistant", "content": "You are welcome."},
]}
# A reasoning turn before the last question: Qwen3 writes its <think> block only after the last question, so a
# turn's prefix renders differently from the whole (rendering prefixes cannot find it; the bundled template can).
REASONING_ROW = {"messages": [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "7", "reasoning_content": "The user adds numbers."},
    {"role": "user", "content": "And 2 + 2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Again."},
]}


def ours(folder, chat_template=""):
    return build_chat_template(HFTokenizer(str(folder / "tokenizer.json")), chat_template)


def transformers_ids_and_mask(folder, row, chat_template=None):
    out = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        row["messages"], tools=row.get("tools"), chat_template=chat_template, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def tokenized(template, row):
    messages = conversation(row, Chat(), "row 0")
    ids, targets = template.tokenize(messages, "row 0", tools=row_tools(row, "row 0"))
    return ids.tolist(), targets.astype(int).tolist()


@pytest.mark.parametrize(("family", "row"), [
    ("qwen2.5", TOOL_ROW), ("qwen3", TOOL_ROW), ("qwen3", REASONING_ROW), ("llama3", REASONING_ROW),
])
def test_bundled_template_marks_what_transformers_marks(tmp_path, family, row):
    """The model's own template (no generation blocks) gives transformers' ids, tools written; the bundled
    template of its family, found by what it writes, gives the assistant mask transformers takes from it."""
    folder = write_chat_tokenizer(tmp_path, family, "tools" if family.startswith("qwen") else "plain")
    template = ours(folder)
    assert template.marked is not None and template.marked.origin == bundled_file(family)
    ids, targets = tokenized(template, row)
    expected_ids, _ = transformers_ids_and_mask(folder, row)
    with open(bundled_file(family), encoding="utf-8") as f:
        marked_ids, mask = transformers_ids_and_mask(folder, row, f.read())
    assert ids == expected_ids == marked_ids
    assert targets == mask and 0 < sum(mask) < len(mask)
    if row is TOOL_ROW:  # the tools offered are in the text, the calls are trained
        text = HFTokenizer(str(folder / "tokenizer.json"))._tokenizer.decode(ids, skip_special_tokens=False)
        assert '"name": "get_weather"' in text and "The weather in a city." in text


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3"])
def test_rendering_prefixes_trains_what_the_bundled_template_marks(tmp_path, family, monkeypatch):
    """Without the bundled templates, tool calls (a null content, tools offered) are found by rendering each
    turn's prefix, and the same tokens train."""
    folder = write_chat_tokenizer(tmp_path, family, "tools")
    bundled = tokenized(ours(folder), TOOL_ROW)
    monkeypatch.setattr(chat_template_choice, "_bundled_alike", lambda model, template: None)
    alone = ours(folder)
    assert alone.marked is None and tokenized(alone, TOOL_ROW) == bundled


def test_a_row_the_bundled_template_writes_otherwise_renders_prefixes(tmp_path):
    """A model template that writes the probes as Qwen2.5 does but one row otherwise keeps its own text (the
    bundled spans are used only where both write the same)."""
    folder = write_chat_tokenizer(tmp_path, "qwen2.5", "tools")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- if tools and tools[0].function.name == 'get_weather' %}{{- '(!)' }}{%- endif %}" + config["chat_template"]
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = ours(folder)
    assert template.marked is not None
    ids, targets = tokenized(template, TOOL_ROW)
    assert ids == transformers_ids_and_mask(folder, TOOL_ROW)[0]
    trained = HFTokenizer(str(folder / "tokenizer.json"))._tokenizer.decode(
        [i for i, t in zip(ids, targets) if t], skip_special_tokens=False)
    assert trained.endswith("You are welcome.<|im_end|>") and "(!)" not in trained
    assert trained.startswith('<tool_call>\n{"name": "get_weather"')


def test_a_bundled_name_is_a_template(tmp_path):
    """training.chat.chat_template = qwen3 (as axolotl and torchtune name templates) is the bundled one."""
    folder = write_chat_tokenizer(tmp_path, "qwen3", None)
    template = ours(folder, "qwen3")
    assert template.marks_generation and template.origin == bundled_file("qwen3")
    with open(bundled_file("qwen3"), encoding="utf-8") as f:
        assert tokenized(template, TOOL_ROW) == transformers_ids_and_mask(folder, TOOL_ROW, f.read())


@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_template_names_are_listed_with_the_tokenizer_route(tmp_path, name):
    with pytest.raises(DataError) as caught:
        build_chat_template(ByteTokenizer(), name)
    message = str(caught.value)
    assert "\n" not in message and "model.tokenizer is byte" in message and "model.hf_assets_path" in message
    assert "plain, a bundled name (llama3, qwen2.5, qwen3) or a .jinja file" in message
    folder = write_chat_tokenizer(tmp_path, "qwen3", None)
    if name == "chatml":
        with pytest.raises(DataError, match="'chatml' is neither a file nor a template dtrain knows; it takes empty"):
            ours(folder, name)


@pytest.mark.parametrize(("row", "expected"), [
    ({"messages": [], "tools": '[{"type": "function"'}, "row 0: field 'tools' is text but not JSON"),
    ({"messages": [], "tools": {"name": "f"}}, "row 0: field 'tools' must be a list of tool schemas"),
])
def test_bad_tools_are_one_line(row, expected):
    with pytest.raises(DataError, match=expected):
        row_tools(row, "row 0")


def test_tools_as_json_text_and_null_content_only_with_calls():
    """Parquet and CSV rows hold tools as JSON text; a null content is an assistant's that only calls."""
    assert row_tools({"tools": json.dumps(TOOLS)}, "row 0") == TOOLS
    user_null = {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "hi"}]}
    with pytest.raises(DataError, match="row 2: a user message's 'content' is NoneType, not text .null only in an "
                                        "assistant turn with tool_calls"):
        conversation(user_null, Chat(), "row 2")
