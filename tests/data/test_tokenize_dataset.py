"""scripts/tokenize_dataset.py and dtrain/data/tokenize_corpus.py: a corpus tokenized once into token shards that
are exactly the packer's stream, byte-identical for any number of workers, resumable after an interruption,
verifiable, and refusing what it cannot do in one line that names the argument."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtrain.data import ByteTokenizer
from dtrain.data.corpus_input import SOURCE_STRIDE, ConcatSource, open_input
from dtrain.data.file_readers import FILE_STRIDE
from dtrain.data.packing import document_tokens
from dtrain.data.shard_verify import verify
from dtrain.data.sources import DocumentSource, FilesSource, SyntheticSource
from dtrain.data.token_shards import TokenShards, token_dtype
from dtrain.data.tokenize_corpus import Progress, command_line_message, tokenize_corpus
from dtrain.errors import DataError

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "tokenize_dataset.py"


@pytest.fixture
def corpus(tmp_path):
    """Two JSONL files and a text file: 61 documents, one of them empty (it still becomes [BOS, EOS])."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    with open(folder / "a.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"line {i} " + "words " * (i % 9)}) + "\n")
    with open(folder / "b.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": "" if i == 3 else f"second file {i} ünïcödé ✓"}) + "\n")
    (folder / "c.txt").write_text("a whole text file is one document\n" * 5)
    return folder


def tokenize(corpus, out, workers=0, shard_tokens=300, tokenizer=None, **kwargs):
    source, info = open_input(str(corpus), "auto", "text")
    return tokenize_corpus(source, info, tokenizer or ByteTokenizer(), str(out), workers=workers,
                           shard_tokens=shard_tokens, **kwargs)


def folder_bytes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def packer_stream(source, tokenizer=None) -> list[np.ndarray]:
    return [document_tokens(d, tokenizer or ByteTokenizer(), "") for _, d in source.documents(0)]


def shard_tokens_of(folder: Path, manifest, dtype=np.uint16) -> np.ndarray:
    return np.concatenate([np.fromfile(folder / s["tokens"], dtype=dtype) for s in manifest["shards"]])


def load_script():
    spec = importlib.util.spec_from_file_location("tokenize_dataset", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shards_are_the_packers_stream_with_document_offsets(corpus, tmp_path):
    out = tmp_path / "out"
    manifest = tokenize(corpus, out)
    documents = packer_stream(FilesSource(str(corpus), "text"))
    assert manifest["complete"] and manifest["num_documents"] == len(documents) == 61
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["kind"] == "byte"
    assert manifest["input"] == {"path": str(corpus), "kind": "files", "text_field": "text",
                                 "next_position": 2 * FILE_STRIDE + 1}
    assert len(manifest["shards"]) > 3 and all(s["num_tokens"] >= 300 for s in manifest["shards"][:-1])
    # A shard is closed by the document that reaches 300 tokens: without its last document it is below.
    for shard in manifest["shards"][:-1]:
        offsets = np.load(out / shard["offsets"])
        assert offsets[-2] < 300 <= offsets[-1] == shard["num_tokens"]
    assert np.array_equal(shard_tokens_of(out, manifest), np.concatenate(documents))
    assert [256, 257] in [list(d) for d in documents]  # the empty document
    starts = np.concatenate([
        np.load(out / s["offsets"])[:-1] + sum(p["num_tokens"] for p in manifest["shards"][:i])
        for i, s in enumerate(manifest["shards"])
    ])
    assert np.array_equal(starts, np.cumsum([0] + [len(d) for d in documents[:-1]]))
    assert "OK, " in verify(str(out))
    # The reader's view of the folder is the same stream.
    shards = TokenShards(str(out), ByteTokenizer())
    assert np.array_equal(shards.read(0, shards.num_tokens), np.concatenate(documents))


def test_any_number_of_workers_writes_the_same_bytes(corpus, tmp_path):
    outputs = [tmp_path / f"w{w}" for w in (0, 1, 2)]
    for workers, out in zip((0, 1, 2), outputs):
        tokenize(corpus, out, workers=workers)
    assert folder_bytes(outputs[0]) == folder_bytes(outputs[1]) == folder_bytes(outputs[2])


class WideVocab(ByteTokenizer):
    vocab_size, bos_id, eos_id = 70_000, 69_998, 69_999


def test_a_vocabulary_beyond_uint16_is_stored_as_uint32(corpus, tmp_path):
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    manifest = tokenize(corpus, tmp_path / "out", tokenizer=WideVocab())
    assert manifest["dtype"] == "uint32"
    documents = packer_stream(FilesSource(str(corpus), "text"), WideVocab())
    assert np.array_equal(shard_tokens_of(tmp_path / "out", manifest, "<u4"), np.concatenate(documents))
    assert "uint32" in verify(str(tmp_path / "out"))


class OutOfVocabulary(ByteTokenizer):
    vocab_size = 200  # bytes above 199 (and BOS/EOS) are outside it


def test_an_id_outside_the_vocabulary_is_refused_not_wrapped(corpus, tmp_path):
    with pytest.raises(DataError, match="outside its vocabulary"):
        tokenize(corpus, tmp_path / "out", tokenizer=OutOfVocabulary())
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert not manifest["complete"] and not [p for p in (tmp_path / "out").iterdir() if p.name.endswith(".tmp")]


class Interrupted(DocumentSource):
    """The documents of `source`, then Ctrl-C at the `stop_at`-th."""

    def __init__(self, source, stop_at):
        self.source, self.stop_at, self.description = source, stop_at, source.description

    def documents(self, start=0):
        for count, item in enumerate(self.source.documents(start)):
            if count == self.stop_at:
                raise KeyboardInterrupt
            yield item


def test_ctrl_c_leaves_whole_shards_and_running_again_finishes_the_same_bytes(corpus, tmp_path):
    tokenize(corpus, tmp_path / "whole")
    out = tmp_path / "out"
    source, info = open_input(str(corpus), "auto", "text")
    with pytest.raises(KeyboardInterrupt):
        tokenize_corpus(Interrupted(source, 30), info, ByteTokenizer(), str(out), shard_tokens=300)
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and 0 < len(manifest["shards"]) < 5
    names = {p.name for p in out.iterdir()}
    assert names == {"manifest.json"} | {s[key] for s in manifest["shards"] for key in ("tokens", "offsets")}
    with pytest.raises(DataError, match="is incomplete"):
        verify(str(out))
    with pytest.raises(DataError, match="incomplete"):
        TokenShards(str(out), ByteTokenizer())
    progress = Progress(enabled=False)
    tokenize(corpus, out, progress=progress)
    assert progress.started and progress.shards > len(manifest["shards"])
    assert folder_bytes(out) == folder_bytes(tmp_path / "whole")


def test_a_crash_between_shards_resumes_to_the_same_bytes(corpus, tmp_path):
    whole = tmp_path / "whole"
    tokenize(corpus, whole, shard_tokens=None)  # default shard size: one shard
    cut = tmp_path / "cut"
    tokenize(corpus, cut)
    # What a crash after shard 2 leaves: the manifest of three shards, a later shard, temporary files.
    manifest = json.loads((cut / "manifest.json").read_text())
    kept = manifest["shards"][:3]
    positions = [p for p, _ in FilesSource(str(corpus), "text").documents(0)]
    manifest.update(shards=kept, complete=False, num_tokens=sum(s["num_tokens"] for s in kept),
                    num_documents=sum(s["num_documents"] for s in kept))
    manifest["input"]["next_position"] = positions[manifest["num_documents"]]
    (cut / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (cut / "shard_00004.tokens.tmp").write_bytes(b"partial")
    (cut / "manifest.json.tmp").write_bytes(b"{")
    (cut / "shard_00003.tokens").write_bytes(b"stale")
    (cut / "notes.md").write_text("the user's own file is left alone")
    reference = tmp_path / "reference"
    tokenize(corpus, reference)
    tokenize(corpus, cut, shard_tokens=None)  # the folder's own shard size (300)
    (cut / "notes.md").unlink()
    assert folder_bytes(cut) == folder_bytes(reference)
    assert folder_bytes(whole) != folder_bytes(reference)  # the shard size is part of the layout


def test_a_complete_folder_is_left_alone(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    tokenize(corpus, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    progress = Progress(enabled=False)
    assert tokenize(corpus, out, progress=progress)["complete"] and not progress.started
    assert load_script().main(["--input", str(corpus), "--output", str(out), "--shard_tokens", "300"]) == 0
    assert "is already complete" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_another_input_tokenizer_shard_size_or_a_foreign_folder_is_refused_untouched(corpus, tmp_path,
                                                                                    hf_tokenizer_dir):
    from dtrain.data.hf_tokenizer import HFTokenizer

    out = tmp_path / "out"
    tokenize(corpus, out)
    before = folder_bytes(out)
    with pytest.raises(DataError, match="holds a tokenization with another tokenizer") as refused:
        tokenize(corpus, out, tokenizer=HFTokenizer(str(hf_tokenizer_dir / "tokenizer.json")))
    assert "\n" not in str(refused.value)
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x")
    with pytest.raises(DataError, match="holds a tokenization with another input"):
        tokenize(other, out)
    with pytest.raises(DataError, match="holds a tokenization with another shard_tokens"):
        tokenize(corpus, out, shard_tokens=1000)
    assert folder_bytes(out) == before
    with pytest.raises(DataError, match="is not empty and holds no manifest.json"):
        tokenize(corpus, other)
    with pytest.raises(DataError, match="is a file"):
        tokenize(corpus, other / "x.txt")
    with pytest.raises(DataError, match=r"--output .*: cannot write .*x\.txt/sub"):
        tokenize(corpus, other / "x.txt" / "sub")
    with pytest.raises(DataError, match="never ends"):
        tokenize_corpus(SyntheticSource(0, 258, 8), {}, ByteTokenizer(), str(tmp_path / "endless"))
    assert sorted(p.name for p in other.iterdir()) == ["x.txt"]


def test_an_hf_tokenizer_is_recorded_with_its_file(corpus, tmp_path, hf_tokenizer_dir):
    from dtrain.data.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    manifest = tokenize(corpus, tmp_path / "out", tokenizer=tokenizer, workers=1)
    expected = hashlib.sha256((hf_tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest["tokenizer"]["kind"] == "hf" and manifest["tokenizer"]["sha256"] == expected
    documents = packer_stream(FilesSource(str(corpus), "text"), tokenizer)
    assert np.array_equal(shard_tokens_of(tmp_path / "out", manifest), np.concatenate(documents))


def test_several_inputs_are_read_one_after_the_other_and_seek(corpus, tmp_path, write_jsonl):
    second = tmp_path / "second.jsonl"
    write_jsonl(second, ["x", "yy", "zzz"])
    source, info = open_input([str(corpus), str(second)], "auto", "text")
    assert isinstance(source, ConcatSource) and info["path"] == [str(corpus), str(second)]
    items = list(source.documents(0))
    assert [d for _, d in items] == [d for _, d in FilesSource(str(corpus), "text").documents(0)] + ["x", "yy", "zzz"]
    assert items[-3][0] == SOURCE_STRIDE
    for index in range(len(items)):  # documents(p) is the tail from p, also across inputs
        assert list(source.documents(items[index][0])) == items[index:]
    manifest = tokenize_corpus(source, info, ByteTokenizer(), str(tmp_path / "out"), shard_tokens=300)
    assert manifest["num_documents"] == 64 and manifest["input"]["path"] == [str(corpus), str(second)]
    with pytest.raises(DataError, match="builtin is a corpus of its own"):
        open_input(["builtin", str(second)])


def test_input_kinds_are_detected(corpus, tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": ["one", "two", "three"]}).save_to_disk(str(saved))
    source, info = open_input(str(saved), "auto", "body")
    assert info["kind"] == "hf" and [d for _, d in source.documents(1)] == ["two", "three"]
    manifest = tokenize_corpus(source, info, ByteTokenizer(), str(tmp_path / "out"), workers=1)
    assert manifest["num_documents"] == 3 and manifest["input"]["next_position"] == 3
    assert open_input(str(corpus))[1]["kind"] == "files"
    assert open_input("builtin")[1] == {"path": "builtin", "kind": "builtin", "text_field": None}
    with pytest.raises(DataError, match="--kind builtin reads the built-in corpus"):
        open_input(str(corpus), "builtin")
    with pytest.raises(DataError, match="must be of one kind"):
        open_input([str(corpus), str(saved)])


def test_verify_finds_damage(corpus, tmp_path):
    out = tmp_path / "out"
    tokenize(corpus, out)
    shard = out / "shard_00001.tokens"
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard_00001.tokens does not match its checksum"):
        verify(str(out))
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=r"shard_00001.tokens is \d+ bytes, its manifest says"):
        verify(str(out))
    tokenize(corpus, tmp_path / "again")
    offsets = tmp_path / "again" / "shard_00000.offsets.npy"
    np.save(offsets, np.load(offsets) + np.array([0] + [1] * (len(np.load(offsets)) - 2) + [0]))
    with pytest.raises(DataError, match="a document does not start with BOS"):
        verify(str(tmp_path / "again"))
    manifest = json.loads((tmp_path / "again" / "manifest.json").read_text())
    del manifest["shards"][0]["num_documents"]
    (tmp_path / "again" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="manifest.json is malformed"):
        verify(str(tmp_path / "again"))


def test_progress_rewrites_one_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    progress = Progress(stream=terminal, interval=0.0)
    progress.start(0, 0, 0)
    progress.update(1, 100)
    progress.shard()
    progress.finish()
    text = terminal.getvalue()
    assert text.startswith("\r1 documents, 100 tokens, ") and "docs/s" in text and "tokens/s" in text
    assert text.count("\n") == 1 and "1 shard(s) written in " in text


def test_script_errors_are_one_line_naming_the_argument(corpus, tmp_path, capsys, monkeypatch):
    script = load_script()
    cases = [
        (["--input", str(tmp_path / "nowhere")], "error: --input "),
        (["--input", str(corpus), "--hf_assets_path", str(tmp_path)], "error: --hf_assets_path "),
        (["--input", str(corpus), "--workers", "-1"], "error: --workers must be"),
        (["--input", str(corpus), "--text_field", "body"], "set --text_field"),
    ]
    for args, expected in cases:
        assert script.main([*args, "--output", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, err
    assert script.main(["--verify", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert command_line_message("set training.dataset_path and model.tokenizer") == "set --input and --tokenizer"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "tokenize_corpus", interrupted)
    assert script.main(["--input", str(corpus), "--output", str(tmp_path / "o")]) == 130
    err = capsys.readouterr().err
    assert "interrupted: " in err and f"--input {corpus} --output {tmp_path / 'o'}" in err


def test_the_script_tokenizes_and_verifies(corpus, tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, str(SCRIPT), "--input", str(corpus), "--output", str(out),
                             "--workers", "1", "--shard_tokens", "500"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "done: " in result.stdout and "61 documents" in result.stdout
    assert "docs/s" in result.stderr and "tokens/s" in result.stderr  # the progress lines
    assert verify(str(out)).startswith(f"{out}: OK, ")
