"""With only training.dataset_path given, validation reads a fixed share of the user's own conversations and
training the rest: disjoint, together the whole file, the same rows every time; validation's own path (or no
validation) leaves training every row."""

import json

from dtrain.config import load_config
from dtrain.data.chat_source import JsonLinesRows
from dtrain.data.held_out import HeldOutRows
from dtrain.run.validation import check_not_training_data, held_out_fraction, validation_data


def positions(rows):
    return [position for position, _, _ in rows.rows()]


def test_validation_and_training_split_the_users_conversations(tmp_path):
    data = tmp_path / "my_chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": str(i)}]}) + "\n"
                            for i in range(400)))
    rows = JsonLinesRows(str(data))
    held, rest = (positions(HeldOutRows(rows, 0.05, held=h)) for h in (True, False))
    assert not set(held) & set(rest) and sorted(held + rest) == positions(rows)
    assert 8 <= len(held) <= 32  # about 5% of 400
    assert held == positions(HeldOutRows(JsonLinesRows(str(data)), 0.05, held=True))  # the same rows every time
    assert held[1:] == [p for p, _, _ in HeldOutRows(rows, 0.05, held=True).rows(held[0] + 1)]  # resumes by position

    cfg = load_config(["--config", "debug_chat", "--training.dataset_path", str(data)])
    assert held_out_fraction(cfg.training, cfg.validation) == 0.05
    validation = validation_data(cfg.validation, cfg.training)
    assert validation.dataset_path == str(data)
    said = check_not_training_data(cfg.training, validation, 0.05)
    assert said == "5% of training.dataset_path's conversations, held out (training.chat.validation_fraction): " \
                   "training never reads them"
    own = load_config(["--config", "debug_chat", "--training.dataset_path", str(data),
                       "--validation.dataset_path", str(data) + ".val"])
    off = load_config(["--config", "debug_chat", "--training.dataset_path", str(data), "--validation.enable", "false"])
    bundled = load_config(["--config", "debug_chat"])
    for other in (own, off, bundled):
        assert held_out_fraction(other.training, other.validation) == 0
