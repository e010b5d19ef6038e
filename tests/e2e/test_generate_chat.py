"""run_generate.sh --chat: a two-turn conversation (with a system prompt) from stdin, answered by a random Qwen3 of
transformers' with Qwen3's real chat template, streams what transformers' greedy `generate` answers on
`apply_chat_template(..., add_generation_prompt=True)`, turn after turn; mistakes are one line."""

from __future__ import annotations

import io

import pytest
import torch

from dtrain.generate import main as generate_main
from tests.data.chat_tokenizers import write_chat_tokenizer

transformers = pytest.importorskip("transformers")

TURNS = ["Hello there!", "What is 3 + 4?"]


def chat_model_folder(folder, template="tools"):
    """A random Qwen3 with a Qwen3-style tokenizer (its real template), stopping at <|im_end|> as Qwen3 does."""
    from tokenizers import Tokenizer

    write_chat_tokenizer(folder, "qwen3", template)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    end_of_turn = tokenizer.token_to_id("<|im_end|>")
    torch.manual_seed(3)
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=256,
        bos_token_id=end_of_turn, eos_token_id=end_of_turn, initializer_range=0.5,
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def chat(monkeypatch, capsys, *args: str, stdin: str = ""):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    capsys.readouterr()  # what saving the model wrote
    code = generate_main(["--device", "cpu", *args])
    return code, capsys.readouterr()


def test_greedy_chat_equals_transformers_turn_after_turn(tmp_path, monkeypatch, capsys):
    model = chat_model_folder(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    code, out = chat(monkeypatch, capsys, "--checkpoint", str(tmp_path), "--hf", "--chat", "--system", "Be brief.",
                     "--max_new_tokens", "12", stdin="\n".join(TURNS) + "\n")
    assert code == 0, out.err
    messages, expected = [{"role": "system", "content": "Be brief."}], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        new = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt):].tolist()
        answer = tokenizer.decode(new, skip_special_tokens=True)
        expected.append(answer)
        messages.append({"role": "assistant", "content": answer})
    assert out.out.splitlines() == expected
    assert all(answer.strip() for answer in expected)  # the model says something each turn
    assert "bundled" in out.err and "qwen3.jinja" in out.err  # the template training would use


def test_streamed_pieces_are_flushed_as_they_come(tmp_path, monkeypatch, capsys):
    """Each decoded piece is written (and flushed) as its token is chosen, not the answer at the end."""
    chat_model_folder(tmp_path)
    writes = []
    real_print = print

    def recording_print(*args, **kwargs):
        if kwargs.get("flush") and "file" not in kwargs:
            writes.append(args[0])
        real_print(*args, **kwargs)

    monkeypatch.setattr("builtins.print", recording_print)
    code, out = chat(monkeypatch, capsys, "--checkpoint", str(tmp_path), "--hf", "--chat", "--prompt", TURNS[0],
                     "--max_new_tokens", "8")
    assert code == 0, out.err
    assert len(writes) > 2 and "".join(writes) + "\n" == out.out  # the last write ends the line


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--chat", "--prompt_ids", "1,2"], "--prompt_ids cannot go with it"),
        (["--system", "Be brief.", "--prompt", "Hi"], "--system is the system prompt of a conversation: add --chat"),
        ([], "give --prompt TEXT, --prompt_ids IDS, or --chat"),
    ],
)
def test_option_mistakes_are_one_line_before_loading(monkeypatch, capsys, tmp_path, args, expected):
    code, out = chat(monkeypatch, capsys, "--checkpoint", str(tmp_path / "absent"), "--hf", *args)
    assert code != 0 and expected in out.err and out.err.count("\n") == 1


def test_a_tokenizer_without_a_chat_template_names_the_key(tmp_path, monkeypatch, capsys):
    chat_model_folder(tmp_path, template=None)
    code, out = chat(monkeypatch, capsys, "--checkpoint", str(tmp_path), "--hf", "--chat", stdin="Hi\n")
    assert code != 0 and out.err.count("\n") == 1
    assert "has no chat template" in out.err and "--training.chat.chat_template" in out.err
    assert "qwen2.5, qwen3" in out.err
