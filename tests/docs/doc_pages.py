"""What the docs tests read and where they run it: the command blocks of README.md and docs/*.md, and a scratch
checkout to run them in as a user would.

A command block is a fenced block labelled bash, python, or unlabelled whose first command line starts like a
command (`./run_train.sh`, `python ...`, `NPROC=2 ./...`); output samples and layouts are not. The scratch checkout
is a folder of links to this repository's files with an `outputs/` of its own, so that `./run_train.sh` and
relative paths behave as in a fresh clone and nothing lands in the developer's own `outputs/`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from run_train_helpers import REPO, user_env

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_COMMAND = re.compile(r"(\./|\.venv/|python |tlparse |rm |tail |source |sbatch |srun |salloc |[A-Z_]+=\S* )")
# What a scratch checkout links to: everything a user's clone has that the commands touch.
_LINKED = ("run_train.sh", "run_generate.sh", "run_eval.sh", "scripts", "train_configs", "dtrain", "models", "parallelize", "tests",
           "docs", "README.md", "pyproject.toml", "setup.py")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository, e.g. docs/data.md
    line: int
    language: str
    text: str

    @property
    def key(self) -> str:
        """Its first command line: what names the block in the tests' table."""
        return next(line.strip() for line in self.text.splitlines() if line.strip() and not line.startswith("#"))


def command_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in _FENCED.finditer(text):
            language, body = match.group(1), match.group(2)
            if language not in ("", "bash", "python") or not body.strip():
                continue
            block = Block(str(page.relative_to(REPO)), text[: match.start()].count("\n") + 1, language, body)
            if language or _COMMAND.match(block.key):
                blocks.append(block)
    return blocks


def run_train_with(script: str, *flags: str) -> str:
    """`script` with `flags` after every ./run_train.sh command (later flags win, so they shorten or check a run),
    continuation lines joined, trailing comments and the docs' `...` (more flags of your own) dropped."""
    lines = []
    for line in script.replace("\\\n", " ").splitlines():
        command = re.sub(r"\s+#.*$", "", line) if not line.lstrip().startswith("#") else line
        if "run_train.sh" in command and not command.lstrip().startswith("#"):
            command = re.sub(r"\s\.\.\.(?=\s|$)", "", command).rstrip() + " " + " ".join(flags)
        lines.append(command)
    return "\n".join(lines)


class Checkout:
    """A scratch clone: links to the repository's files, the test interpreter's environment as its `.venv`."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        for name in _LINKED:
            (root / name).symlink_to(REPO / name)
        (root / ".venv").symlink_to(Path(sys.prefix))

    def run(self, script: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        """`script` through bash as a user's fresh shell runs it (no environment activated: `python` is the
        system's, the checkout's .venv is the one the README's set-up made), stopping at the first failing
        command."""
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=self.root,
                              env=fresh_shell_env(HF_HUB_OFFLINE="1", **env), capture_output=True, text=True,
                              timeout=timeout)

    def ok(self, script: str, timeout: float = 300, **env: str) -> str:
        """The output (stdout, then stderr) of `script`, which must succeed."""
        done = self.run(script, timeout=timeout, **env)
        assert done.returncode == 0, f"{script}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done.stdout + done.stderr

    def one_error_line(self, script: str, code: int, **env: str) -> str:
        """The single `error: ...` line `script` ends with, exiting `code` (a refusal, not a traceback)."""
        done = self.run(script, **env)
        lines = [line for line in done.stderr.splitlines() if not line.startswith("[rank")]
        assert done.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), (
            f"{script}\nexit {done.returncode}\n{done.stderr[-3000:]}")
        return lines[0]


def fresh_shell_env(**extra: str) -> dict[str, str]:
    """The test environment as a new shell has it: without the test interpreter's environment activated."""
    env = user_env(**extra)
    for name in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        env.pop(name, None)
    active = {str(Path(sys.executable).parent), str(Path(sys.prefix) / "bin")}
    env["PATH"] = os.pathsep.join(folder for folder in env["PATH"].split(os.pathsep) if folder not in active)
    return env


def newest_step(run_dir: Path) -> int:
    return max(int(path.name.removeprefix("step-")) for path in (run_dir / "checkpoint").glob("step-*")
               if path.name.removeprefix("step-").isdigit())


def environment_has(command: str) -> bool:
    return any((Path(folder) / command).exists() for folder in os.environ.get("PATH", "").split(os.pathsep))


# Helpers of the checks: a Python block, a tiny Hugging Face model, a config as a launch resolves it.
CHECK_CONFIG = ("--job.print_config",)


def run_python(checkout: Checkout, source: str) -> str:
    """A page's Python block, run in dtrain's environment (the checkout's .venv), as code that imports dtrain is."""
    (checkout.root / "snippet.py").write_text(source)
    return checkout.ok(".venv/bin/python snippet.py")


def tiny_hf_model(folder: Path, family: str) -> None:
    """A random transformers model of `family` with a byte-level tokenizer, saved as a Hugging Face folder."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["Hello world, hello docs."], trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=320, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    config = (transformers.Qwen3Config(**shape, head_dim=16) if family == "qwen3"
              else transformers.LlamaConfig(**shape))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def with_models(command: str, checkout: Checkout) -> str:
    return command.replace(" /models/", f" {checkout.root}/hf_models/")


def hf_generation(checkout: Checkout, command: str) -> None:
    if not (checkout.root / "hf_models" / "Qwen3-0.6B").exists():
        tiny_hf_model(checkout.root / "hf_models" / "Qwen3-0.6B", "qwen3")
    assert "ids: " in checkout.ok(with_models(command, checkout))


def checked_config(checkout: Checkout, command: str) -> str:
    """`command`'s config as the launch would resolve it (keys, types, choices and bounds checked; nothing run:
    `--job.print_config` answers before the pre-flight that needs the world, the assets and the memory)."""
    printed = checkout.ok(run_train_with(command, *CHECK_CONFIG))
    assert "[training]" in printed
    return printed


# README.md: the tour, top to bottom.
