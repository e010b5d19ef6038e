"""A data path that does not exist is named absolute, with the nearest existing name beside it."""

from dtrain.data.missing_path import missing


def test_a_typo_names_the_absolute_path_and_the_file_meant(tmp_path, monkeypatch):
    (tmp_path / "my_chats.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    said = missing("my_chat.jsonl")
    assert said == f"'my_chat.jsonl' ({tmp_path / 'my_chat.jsonl'}) does not exist; nearest: {tmp_path / 'my_chats.jsonl'}"
    assert missing(str(tmp_path / "zzz" / "a.txt")).endswith(f"does not exist (nor its folder {tmp_path / 'zzz'})")
