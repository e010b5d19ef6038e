"""The preference tests' helpers on sys.path: the chat tokenizer folders of tests/data, the gloo worlds and tiny
models of tests/parallelize."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallelize"))
