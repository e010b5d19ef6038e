"""Chat templates against transformers: the ids equal `apply_chat_template(..., tokenize=True)` and the trained
tokens equal transformers' assistant mask, for Llama 3 and Qwen3 style tokenizer folders built here."""

from __future__ import annotations

import json
import re
import logging

import numpy as np
import pytest

from dtrain.data.chat_template import JinjaChatTemplate, PlainChatTemplate
from dtrain.data.chat_template_choice import build_chat_template
from dtrain.data.hf_tokenizer import HFTokenizer
from dtrain.data.tokenizer import ByteTokenizer
from dtrain.errors import DataError
from tests.data.chat_tokenizers import write_chat_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "12 + 30 = 42."}],
    [
        {"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hello! How are you today?"},
        {"role": "user", "content": "I am fine. What is 3 + 4?"},
        {"role": "assistant", "content": "<think>\nThe user adds numbers.\n</think>\n\nThe answer is 7."},
        {"role": "user", "content": "thank you"},
        {"role": "assistant", "content": "  You are welcome.\n"},
    ],
    [
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "7", "reasoning": "The user adds numbers."},
        {"role": "assistant", "content": "Anything else?"},
    ],
]


def transformers_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def transformers_ids_and_mask(folder, messages):
    out = transformers_tokenizer(folder).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_ids_and_assistant_tokens_equal_transformers(tmp_path, family):
    """Our ids are transformers' for the family's own template; the assistant tokens found by rendering prefixes
    (the template has no generation blocks) are those transformers marks in the same template with its answers
    wrapped in {% generation %}, and our reading of that template's blocks agrees too."""
    plain = write_chat_tokenizer(tmp_path / "plain", family, "plain")
    marked = write_chat_tokenizer(tmp_path / "marked", family, "generation")
    ours_plain = build_chat_template(HFTokenizer(str(plain / "tokenizer.json")))
    ours_marked = build_chat_template(HFTokenizer(str(marked / "tokenizer.json")))
    assert isinstance(ours_plain, JinjaChatTemplate) and not ours_plain.marks_generation
    assert ours_marked.marks_generation
    hf = transformers_tokenizer(plain)
    for messages in CONVERSATIONS:
        expected_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        ids, targets = ours_plain.tokenize(messages, "row 0")
        assert ids.tolist() == list(expected_ids)
        marked_ids, mask = transformers_ids_and_mask(marked, messages)
        assert marked_ids == ids.tolist()  # the generation tags change no text
        assert targets.astype(int).tolist() == mask
        assert ours_marked.tokenize(messages, "row 0")[1].astype(int).tolist() == mask
        assert 0 < targets.sum() < len(targets)


def test_assistant_turns_and_their_end_token_are_the_targets(tmp_path):
    """Multi-turn Llama 3: each answer and its <|eot_id|> are trained, headers and the user's turns are not."""
    folder = write_chat_tokenizer(tmp_path / "llama3", "llama3", "plain")
    tokenizer = HFTokenizer(str(folder / "tokenizer.json"))
    ids, targets = build_chat_template(tokenizer).tokenize(CONVERSATIONS[1], "row 0")
    trained = tokenizer._tokenizer.decode(ids[targets].tolist(), skip_special_tokens=False)
    assert trained == (
        "Hello! How are you today?<|eot_id|><think>\nThe user adds numbers.\n</think>\n\nThe answer is 7.<|eot_id|>"
        "You are welcome.<|eot_id|>"
    )


def test_plain_template_when_the_tokenizer_has_none(tmp_path, caplog):
    folder = write_chat_tokenizer(tmp_path / "bare", "llama3", None)
    with caplog.at_level(logging.INFO, logger="dtrain"):
        template = build_chat_template(HFTokenizer(str(folder / "tokenizer.json")))
        byte_template = build_chat_template(ByteTokenizer())
    assert isinstance(template, PlainChatTemplate) and isinstance(byte_template, PlainChatTemplate)
    assert "has no chat_template" in caplog.text and "the byte tokenizer has no chat template" in caplog.text
    ids, targets = byte_template.tokenize(CONVERSATIONS[0], "row 0")
    assert ids[0] == ByteTokenizer.bos_id and ids[-1] == ByteTokenizer.eos_id
    assert bytes(ids[targets][:-1].tolist()).decode() == "12 + 30 = 42."


def test_a_chat_template_file_wins_over_tokenizer_config(tmp_path):
    """transformers reads chat_template.jinja before tokenizer_config.json's chat_template."""
    folder = write_chat_tokenizer(tmp_path / "qwen3", "qwen3", "plain")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}")
    tokenizer = HFTokenizer(str(folder / "tokenizer.json"))
    ids, _ = build_chat_template(tokenizer).tokenize(CONVERSATIONS[0], "row 0")
    assert ids.tolist() == transformers_tokenizer(folder).apply_chat_template(CONVERSATIONS[0], return_dict=False)
    assert tokenizer.decode(ids.tolist()) == "What is 12 + 30?12 + 30 = 42."


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ raise_exception('Conversation roles must alternate') }}", "does not render row 7: Conversation roles"),
        ("{% for m in messages %}{{ m.content }", "does not compile: line 1: unexpected '}'"),
    ],
)
def test_a_template_that_does_not_render_is_one_line(tmp_path, template, expected):
    folder = write_chat_tokenizer(tmp_path / "llama3", "llama3", None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    with pytest.raises(DataError, match=expected) as caught:
        build_chat_template(HFTokenizer(str(folder / "tokenizer.json"))).tokenize(CONVERSATIONS[0], "row 7")
    assert "\n" not in str(caught.value)


def test_a_template_whose_prefix_renders_differently_is_refused(tmp_path):
    """A template that writes the number of messages first cannot be cut into turns by rendering prefixes."""
    folder = write_chat_tokenizer(tmp_path / "llama3", "llama3", None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = "{{ messages | length }}{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    with pytest.raises(DataError, match="renders the start of row 3 differently.*train_on_input"):
        build_chat_template(HFTokenizer(str(folder / "tokenizer.json"))).tokenize(CONVERSATIONS[0], "row 3")


def test_plain_template_targets_are_the_answers_only():
    ids, targets = PlainChatTemplate(ByteTokenizer()).tokenize(CONVERSATIONS[1], "row 0")
    answers = [m["content"] for m in CONVERSATIONS[1] if m["role"] == "assistant"]
    assert np.count_nonzero(targets) == sum(len(a.encode()) + 1 for a in answers)


def test_training_on_all_tokens_needs_no_turns(tmp_path):
    """A template whose turns cannot be found still trains on every token with train_on_input."""
    folder = write_chat_tokenizer(tmp_path / "llama3", "llama3", None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = "{{ messages | length }}{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    ids, targets = build_chat_template(HFTokenizer(str(folder / "tokenizer.json"))).tokenize(
        CONVERSATIONS[0], "row 3", find_targets=False
    )
    assert targets.all() and len(ids) > 5


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CALLS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris")]},
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Let me convert that.", "tool_calls": [call("to_f", c=21), call("log", x=1)]},
    {"role": "tool", "content": "70"},
    {"role": "assistant", "content": "It is sunny and 70 F."},
]
TRAINED_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    'Let me convert that.\n<tool_call>\n{"name": "to_f", "arguments": {"c": 21}}\n</tool_call>\n'
    '<tool_call>\n{"name": "log", "arguments": {"x": 1}}\n</tool_call><|im_end|>'
)


@pytest.mark.parametrize(
    ("family", "last_answer"),
    [("qwen2.5", "It is sunny and 70 F."), ("qwen3", "<think>\n\n</think>\n\nIt is sunny and 70 F.")],
)
def test_tool_calls_train_with_their_end_of_turn_token(tmp_path, family, last_answer):
    """Qwen2.5's and Qwen3's own templates write a turn's tool calls after its content: the calls and the
    <|im_end|> after them are trained, as transformers' assistant mask marks them in the template with the calls
    in {% generation %} (which marks the newline that ends the turn's header too, and the answers not at all)."""
    plain = write_chat_tokenizer(tmp_path / "plain", family, "tools")
    marked = write_chat_tokenizer(tmp_path / "marked", family, "tools_generation")
    tokenizer = HFTokenizer(str(plain / "tokenizer.json"))
    ids, targets = build_chat_template(tokenizer).tokenize(TOOL_CALLS, "row 0")
    assert ids.tolist() == transformers_tokenizer(plain).apply_chat_template(TOOL_CALLS, return_dict=False)
    trained = tokenizer._tokenizer.decode(ids[targets].tolist(), skip_special_tokens=False)
    assert trained == TRAINED_CALLS + last_answer + "<|im_end|>"
    marked_ids, mask = transformers_ids_and_mask(marked, TOOL_CALLS)
    mask = np.asarray(mask, dtype=bool)
    assert marked_ids == ids.tolist() and mask.any()
    assert set(tokenizer._tokenizer.decode(ids[mask & ~targets].tolist())) <= {"\n"}
    ours_marked = build_chat_template(HFTokenizer(str(marked / "tokenizer.json"))).tokenize(TOOL_CALLS, "row 0")[1]
    assert ours_marked.tolist() == mask.tolist()


WRITES_NO_CALLS = "{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}"
CALLS_AT_THE_END = WRITES_NO_CALLS + "{% for m in messages %}{{ m.tool_calls | tojson if m.tool_calls }}{% endfor %}"
CALLS_OUTSIDE_GENERATION = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|eot_id|>{% endgeneration %}"
    "{{ m.tool_calls | tojson if m.tool_calls }}{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (WRITES_NO_CALLS, "does not write the tool_calls of row 5, so they would not be trained"),
        (CALLS_AT_THE_END, "writes the tool_calls of row 5 outside the assistant's turn"),
        (CALLS_OUTSIDE_GENERATION, "writes the tool_calls of row 5 outside its {% generation %} blocks"),
        (None, "row 5 makes tool calls, which the plain chat template cannot write"),
    ],
)
def test_tool_calls_a_template_leaves_untrained_are_refused(tmp_path, template, expected):
    """Tool calls that would train nothing (not written, written outside the turn or outside the generation
    blocks, or the plain template) are one line, not a silent gap."""
    folder = write_chat_tokenizer(tmp_path / "llama3", "llama3", None)
    if template is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    chat_template = build_chat_template(HFTokenizer(str(folder / "tokenizer.json")))
    with pytest.raises(DataError, match=re.escape(expected)) as caught:
        chat_template.tokenize(TOOL_CALLS[:2], "row 5")
    assert "\n" not in str(caught.value)
