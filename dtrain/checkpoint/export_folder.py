"""The folder an export (scripts/convert_checkpoint.py to-hf, to-peft) writes.

An export never mixes with what a folder already holds (a Hugging Face model next to an adapter, a checkpoint's own
files): the folder must be new, empty, or an earlier export of the same kind, which is then replaced whole. Every
safetensors file of an export carries its kind in the file's metadata (EXPORT_KEY), which is how an earlier export is
told from a model that someone else wrote. The export is written into a temporary folder beside the target and
swapped in once complete, so a failed export leaves the earlier one in place; its files get the user's umask, which
safetensors' own writer does not apply (it leaves them 0600).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from dtrain.errors import ConfigError

# The safetensors metadata key that names the export kind ("hf" or "peft") of the file's folder.
EXPORT_KEY = "dtrain_export"
# The files each kind writes: hf_io.save_hf (a single file, or shards with their index) and peft_export.
KIND_FILES = {
    "hf": re.compile(
        r"^(config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json)$"
    ),
    "peft": re.compile(r"^(adapter_config\.json|adapter_model\.safetensors)$"),
}
COMMANDS = {"hf": "to-hf", "peft": "to-peft"}


def export_mark(kind: str) -> dict[str, str]:
    """The safetensors metadata of an export's files: PyTorch's format, and the kind that tells an earlier export."""
    return {"format": "pt", EXPORT_KEY: kind}


def check_export_folder(out: Path, kind: str) -> None:
    """Refuse, in one line, an output folder an export of `kind` may not write: a file, or a folder that holds
    anything but an earlier export of the same kind."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} is a file; name a new or empty folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    command = COMMANDS[kind]
    foreign = sorted(p.name for p in out.iterdir() if not (p.is_file() and KIND_FILES[kind].match(p.name)))
    if foreign:
        raise ConfigError(f"output {out} is not empty and holds {foreign[0]}, which {command} does not write: name a "
                          f"new or empty folder (an earlier {command} export there is replaced)")
    for file in sorted(out.glob("*.safetensors")):
        written_by = _export_kind(file)
        if written_by != kind:
            by = f"a {COMMANDS[written_by]} export" if written_by in COMMANDS else "not an export of dtrain's"
            raise ConfigError(f"output {out} holds {file.name}, which is {by}: name a new or empty folder (an earlier "
                              f"{command} export there is replaced)")


def write_export(out: Path, kind: str, write: Callable[[Path], list[Path]]) -> list[Path]:
    """Run `write` (which writes the export into the folder it is given and returns its files) into a temporary
    folder beside `out`, then put that folder in place of `out` (checked by check_export_folder first); returns the
    files at their final paths."""
    check_export_folder(out, kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".writing", dir=out.parent))
    try:
        files = write(temporary)
        _apply_umask(temporary)
        _swap_in(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return [out / file.name for file in files]


def _export_kind(file: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return (handle.metadata() or {}).get(EXPORT_KEY)
    except Exception:  # a torn or foreign file: not an export to replace
        return None


def _apply_umask(folder: Path) -> None:
    """Give `folder` and its files the modes a plain open() under the user's umask would (mkdtemp and safetensors
    create them owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _swap_in(temporary: Path, out: Path) -> None:
    """Rename `temporary` to `out`; an earlier export there is renamed aside first and deleted after, so that `out`
    is at every moment the old export or the whole new one (or briefly absent)."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".replaced", dir=out.parent))
        os.replace(out, old / out.name)
    elif out.is_dir():
        out.rmdir()
    os.replace(temporary, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
