"""Chat rows: JSON-lines files and local Hugging Face datasets, field mappings, and one-line errors for bad rows."""

from __future__ import annotations

import json

import pytest

from dtrain.config.schema_chat import Chat
from dtrain.data.chat_packing import ChatSamples
from dtrain.data.chat_source import BUNDLED, build_chat_rows, conversation
from dtrain.data.chat_template import PlainChatTemplate
from dtrain.data.tokenizer import ByteTokenizer
from dtrain.errors import DataError

CHAT = [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def conversations(path, chat=None):
    chat = chat or Chat()
    return [conversation(row, chat, where) for _, where, row in build_chat_rows(str(path), chat).rows()]


def test_messages_and_prompt_completion_rows(tmp_path):
    """Files of a folder are read in path order; prompt/completion pairs (texts, or message lists as TRL writes
    them) become a user turn and an assistant turn."""
    write_rows(tmp_path / "b.jsonl", [{"prompt": "2 + 2?", "completion": "4"}])
    write_rows(tmp_path / "a.jsonl", [{"messages": CHAT}, {"prompt": [CHAT[0]], "completion": [CHAT[1]]}])
    assert conversations(tmp_path) == [CHAT, CHAT, CHAT]


def test_field_mapping_reads_sharegpt(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "2 + 2?"}, {"from": "gpt", "value": "4"}]}]
    chat = Chat(messages_field="conversations", role_field="from", content_field="value")
    assert conversations(write_rows(tmp_path / "share.jsonl", rows), chat) == [CHAT]
    chat = Chat(prompt_field="question", completion_field="answer")
    assert conversations(write_rows(tmp_path / "qa.jsonl", [{"question": "2 + 2?", "answer": "4"}]), chat) == [CHAT]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": [CHAT[0]]}, r"chats.jsonl line 2 has no assistant turn"),
        ({"turns": CHAT}, r"line 2 has neither 'messages' nor 'prompt' \+ 'completion' \(fields: turns\); set "
                          r"training.chat.messages_field"),
        ({"messages": [{"speaker": "user", "content": "hi"}]}, r"line 2: a message has no field 'role' \(fields: "
                                                               r"content, speaker\); set training.chat.role_field"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, r"line 2: role 'robot' is not one of"),
        ({"messages": [{"role": "user", "content": 3}]}, r"line 2: a user message's 'content' is int, not text"),
    ],
)
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path, row, message):
    path = write_rows(tmp_path / "chats.jsonl", [{"messages": CHAT}, row])
    with pytest.raises(DataError, match=message) as caught:
        conversations(path)
    assert "\n" not in str(caught.value)


def test_a_line_that_is_not_json_and_an_empty_dataset(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl line 2 is not valid JSON"):
        conversations(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    rows = build_chat_rows(str(empty), Chat())
    with pytest.raises(DataError, match="holds no rows; check training.dataset_path"):
        ChatSamples(rows, PlainChatTemplate(ByteTokenizer()), Chat(), 64, ByteTokenizer.eos_id)


def test_resume_seeks_to_a_position(tmp_path):
    write_rows(tmp_path / "a.jsonl", [{"messages": CHAT}] * 3)
    write_rows(tmp_path / "b.jsonl", [{"prompt": "x", "completion": "y"}] * 2)
    rows = build_chat_rows(str(tmp_path), Chat())
    everything = list(rows.rows())
    assert list(rows.rows(everything[3][0])) == everything[3:]


def test_hugging_face_datasets_saved_and_streamed(tmp_path):
    """A save_to_disk folder (load_from_disk) and data files streamed by load_dataset give the JSON-lines rows."""
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": CHAT}, {"messages": [*CHAT, {"role": "user", "content": "and 3 + 3?"},
                                              {"role": "assistant", "content": "6"}]}]
    expected = conversations(write_rows(tmp_path / "chats.jsonl", rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    saved = build_chat_rows(str(tmp_path / "saved"), Chat())
    assert "Hugging Face" in saved.description
    assert conversations(tmp_path / "saved") == expected
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chats.parquet"))
    assert conversations(tmp_path / "chats.parquet", Chat(streaming=True)) == expected
    assert [p for p, _, _ in saved.rows(1)] == [1]


def test_bundled_files_have_answers():
    for split, path in BUNDLED.items():
        found = conversations(path)
        assert len(found) >= 16, split
