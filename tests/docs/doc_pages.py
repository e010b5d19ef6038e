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
_LINKED = ("run_train.sh", "run_generate.sh", "scripts", "train_configs", "dtrain", "models", "parallelize", "tests",
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
        """`script` through bash as a user's shell runs it, stopping at the first failing command."""
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=self.root,
                              env=user_env(HF_HUB_OFFLINE="1", **env), capture_output=True, text=True,
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


def newest_step(run_dir: Path) -> int:
    return max(int(path.name.removeprefix("step-")) for path in (run_dir / "checkpoint").glob("step-*")
               if path.name.removeprefix("step-").isdigit())


def environment_has(command: str) -> bool:
    return any((Path(folder) / command).exists() for folder in os.environ.get("PATH", "").split(os.pathsep))
