"""How a data path that does not exist is named in errors: as given, absolute (a relative path is read from the
launch folder, which is not always the one the user thinks), and with the nearest existing name beside it
(`my_chat.jsonl` where `my_chats.jsonl` is)."""

from __future__ import annotations

import difflib
from pathlib import Path


def missing(path: str) -> str:
    """`'<path>' (<absolute>) does not exist[; nearest: <name>]`."""
    absolute = Path(path).expanduser().absolute()
    said = f"{path!r}" if str(absolute) == path else f"{path!r} ({absolute})"
    folder = absolute.parent
    if not folder.is_dir():
        return f"{said} does not exist (nor its folder {folder})"
    names = [entry.name for entry in folder.iterdir() if not entry.name.startswith(".")]
    nearest = difflib.get_close_matches(absolute.name, names, n=1, cutoff=0.6)
    return f"{said} does not exist" + (f"; nearest: {folder / nearest[0]}" if nearest else "")
