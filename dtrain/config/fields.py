"""A flat, typed view of the config schema: one `FieldSpec` per `section.key`.

The loader, the CLI parser, `--help`, validation and the generated docs all read the schema through this
module, so the dataclasses in `schema.py` stay the single source of truth for names, types, defaults and docs.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from dtrain.config.schema import JobConfig

# The value kinds a field may have. Each maps to one parser (CLI) and one checker (TOML / Python values). A "table"
# holds key = value pairs checked later against something the schema does not know (the family's model args).
KINDS = ("bool", "int", "float", "str", "list", "nested_list", "table")


@dataclass(frozen=True)
class FieldSpec:
    """One config key: where it lives, what it holds, and what values are valid."""

    section: str
    name: str
    kind: str  # one of KINDS; "list" is always a list of strings, "table" a dict of scalars or dicts of scalars
    optional: bool  # None is a valid value (unset)
    default: Any
    doc: str
    choices: tuple | None
    minimum: float | None

    @property
    def key(self) -> str:
        """The dotted name used on the command line and in messages, e.g. ``training.steps``."""
        return f"{self.section}.{self.name}"

    @property
    def type_name(self) -> str:
        """A short human name of the type, as `--help` and the docs show it."""
        base = {"list": "list[str]", "nested_list": "list[list[str]]"}.get(self.kind, self.kind)
        if self.kind == "table":
            return "table"
        return f"{base} | none" if self.optional else base


def _kind_of(annotation: Any, where: str) -> tuple[str, bool]:
    """Map a resolved type annotation to (kind, optional); anything else is a schema bug."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"config field {where}: only X | None unions are supported, got {annotation}")
        optional = True
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if origin is list:
        if typing.get_args(annotation) == (str,):
            return "list", optional
        if typing.get_args(annotation) == (list[str],):
            return "nested_list", optional
        raise TypeError(f"config field {where}: only list[str] and list[list[str]] are supported, got {annotation}")
    if origin is dict:
        return "table", optional
    simple = {bool: "bool", int: "int", float: "float", str: "str"}
    if annotation not in simple:
        raise TypeError(f"config field {where}: unsupported type {annotation}")
    return simple[annotation], optional


@lru_cache(maxsize=1)
def section_classes() -> dict[str, type]:
    """Section name -> its dataclass, in schema order. A field whose type is a dataclass is a section nested in its
    parent, named by its dotted path as its TOML table is (``quantize.linear.float8``)."""
    sections: dict[str, type] = {}

    def visit(prefix: str, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                name = f"{prefix}{f.name}"
                sections[name] = hints[f.name]
                visit(f"{name}.", hints[f.name])

    visit("", JobConfig)
    return sections


def section_of(cfg: Any, section: str) -> Any:
    """The dataclass instance of `section` (a dotted path for a nested one) inside `cfg`."""
    for name in section.split("."):
        cfg = getattr(cfg, name)
    return cfg


@lru_cache(maxsize=1)
def config_fields() -> dict[str, FieldSpec]:
    """Every config key (``section.key``) -> its FieldSpec, in schema order."""
    specs: dict[str, FieldSpec] = {}
    for section, cls in section_classes().items():
        hints = typing.get_type_hints(cls)
        instance = cls()
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a nested section, visited on its own
            kind, optional = _kind_of(hints[f.name], f"{section}.{f.name}")
            spec = FieldSpec(
                section=section,
                name=f.name,
                kind=kind,
                optional=optional,
                default=getattr(instance, f.name),
                doc=f.metadata.get("doc", ""),
                choices=f.metadata.get("choices"),
                minimum=f.metadata.get("minimum"),
            )
            specs[spec.key] = spec
    return specs


def section_names() -> list[str]:
    """The names of the sections that hold keys, in schema order (``quantize`` only holds other sections)."""
    holding = {spec.section for spec in config_fields().values()}
    return [name for name in section_classes() if name in holding]


def suggest_key(name: str) -> str | None:
    """The closest valid ``section.key`` to a misspelled one, or None when nothing is close.

    Field names are compared within the (possibly corrected) section rather than as whole dotted keys, because
    a shared `section.` prefix alone would make unrelated keys look similar.
    """
    specs = config_fields()
    section, _, field_part = name.rpartition(".")
    if section in section_classes():
        sections = [section]
    else:
        sections = difflib.get_close_matches(section, section_names(), n=1, cutoff=0.6) if section else []
    for candidate in sections:
        names = [s.name for s in specs.values() if s.section == candidate]
        close = difflib.get_close_matches(field_part, names, n=1, cutoff=0.6)
        if close:
            return f"{candidate}.{close[0]}"
    # Given without a section (`steps`) or under the wrong one (`training.warmup_steps`): match the field name.
    by_field: dict[str, str] = {}
    for key, spec in specs.items():
        by_field.setdefault(spec.name, key)
    close = difflib.get_close_matches(field_part, by_field, n=1, cutoff=0.8)
    return by_field[close[0]] if close else None


def unknown_key_message(name: str, where: str = "") -> str:
    """An unknown-key error: the key (and `where`, e.g. " in FILE"), then a suggestion or what is valid there."""
    suggestion = suggest_key(name)
    if suggestion:
        return f"unknown key {name}{where} (did you mean {suggestion}?)"
    section = name.rpartition(".")[0]
    if section in section_names():
        names = ", ".join(s.name for s in config_fields().values() if s.section == section)
        return f"unknown key {name}{where} (keys of {section}: {names})"
    return f"unknown key {name}{where} (sections: {', '.join(section_names())}; see --help)"


def unknown_section_message(section: str, where: str = "") -> str:
    """An unknown-section error (an empty TOML table), with the closest section name when there is one."""
    close = difflib.get_close_matches(section, section_names(), n=1, cutoff=0.6)
    hint = f"did you mean [{close[0]}]?" if close else f"sections: {', '.join(section_names())}"
    return f"unknown section [{section}]{where} ({hint})"
