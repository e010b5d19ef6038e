"""Every key the migration guide calls "same" means in dtrain what it means in torchtitan 0.2.2, defaults included
(issue 27).

torchtitan's package runs in a process of its own (torchtitan_config_reference.py: it needs a triton stand-in that
must not enter this process); it dumps its `JobConfig()` defaults and what its `ConfigManager` parses from the
command lines built here. This file checks against that:
- the table of docs/migrating-from-torchtitan.md lists exactly torchtitan's keys;
- a "same" key has torchtitan's default, unless its row says "default differs" (and then names torchtitan's);
- torchtitan's parser and dtrain's give every "same" key the same value from the same TOML file and flags: the
  vendored torchtitan files, and one file that sets every such key away from both defaults;
- every "same" row names the test that shows the key's behaviour, and that test exists (a "same name, differs"
  row says what differs instead);
- training.gc_freq and comm.init_timeout_seconds, which no other test covered, act as in torchtitan.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest
import tomllib
from reference_scripts import run_reference_script

from dtrain.config import load_config
from dtrain.config.fields import config_fields, section_of
from dtrain.config.toml_io import toml_value
from dtrain.config.torchtitan_comparison import (
    DEFAULT_DIFFERENCES,
    MEANING_DIFFERENCES,
    PROVEN_SAME,
    TESTED_SAME,
    TORCHTITAN_V0_2_2_KEYS,
)
from dtrain.config.torchtitan_keys import TORCHTITAN_ONLY
from dtrain.config.torchtitan_table import key_status

REPO = Path(__file__).resolve().parents[2]
TOMLS = sorted((REPO / "tests" / "config" / "torchtitan_v0_2_2").glob("*.toml"))
# Keys dtrain has under torchtitan's name: "same", or "same name, differs" (whose row says how).
SHARED = [key for key in TORCHTITAN_V0_2_2_KEYS if key in config_fields()]
SAME = [key for key in SHARED if key_status(key)[0] == "same"]

# Flags on top of a vendored file, in spellings both parsers take: `--key value`, `--key=value`, booleans as
# `--section.flag` / `--section.no_flag`, lists comma-separated.
FLAGS = [
    "--training.steps", "7", "--optimizer.lr=3e-4", "--lr_scheduler.total_steps", "5",
    "--compile.components", "model,loss", "--metrics.no_enable_tensorboard", "--checkpoint.enable",
    "--activation_checkpoint.mode", "full", "--training.dataset", "c4_test", "--validation.steps", "3",
]
# Flags on top of the file that sets every key: back to defaults, and to a third value.
FLAGS_ON_EVERY_KEY = [
    "--checkpoint.no_enable", "--training.steps=9", "--compile.components", "model,loss",
    "--parallelism.pipeline_parallel_schedule", "1F1B", "--quantize.linear.float8.filter_fqns", "output,w2",
    "--debug.seed", "7", "--job.description", "two words",
]
# Values that pass dtrain's checks where the generic pick below would not (they must still differ from defaults,
# except for expert_tensor_parallel_degree: dtrain refuses every value but torchtitan's default 1).
VALID_TOGETHER = {
    "model.name": "qwen3", "model.flavor": "0.6B", "model.converters": ["quantize.linear.float8"],
    "training.global_batch_size": 20, "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
    "parallelism.pipeline_parallel_microbatch_size": 5, "parallelism.expert_tensor_parallel_degree": 1,
    "compile.components": ["model"], "activation_checkpoint.selective_ac_option": "op",
    "validation.dataset": "files", "quantize.linear.float8.recipe_name": "tensorwise",
    "fault_tolerance.replica_id": 1, "fault_tolerance.min_replica_size": 2,
}
# TOML has no null: where torchtitan's default is None (unset), dtrain's unset is the empty string or list.
UNSET = (None, "", [])


def value_other_than_default(key: str):
    spec = config_fields()[key]
    if key in VALID_TOGETHER:
        return VALID_TOGETHER[key]
    if spec.choices:
        return next(choice for choice in spec.choices if choice != spec.default)
    default = spec.default
    return {
        "bool": lambda: not default,
        "int": lambda: default + 2 if default and default >= 1 else 2,
        "float": lambda: default / 2 if default else 0.25,
        "str": lambda: (default or "x") + "_2",
        "list": lambda: ["a", "b"],
        "nested_list": lambda: [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]],
    }[spec.kind]()


def write_every_key_toml(path: Path) -> None:
    sections = collections.defaultdict(dict)
    for key in SHARED:
        if key != "job.config_file":
            section, name = key.rsplit(".", 1)
            sections[section][name] = value_other_than_default(key)
    path.write_text("\n".join(
        f"[{section}]\n" + "".join(f"{name} = {toml_value(value)}\n" for name, value in values.items())
        for section, values in sections.items()
    ))


@pytest.fixture(scope="module")
def command_lines(tmp_path_factory) -> list[list[str]]:
    every_key = (tmp_path_factory.mktemp("every_key") / "every_key.toml").resolve()
    write_every_key_toml(every_key)
    lines = [["--job.config_file", str(path), *FLAGS] for path in TOMLS]
    return lines + [["--job.config_file", str(every_key)], ["--job.config_file", str(every_key), *FLAGS_ON_EVERY_KEY]]


@pytest.fixture(scope="module")
def torchtitan(tmp_path_factory, command_lines) -> dict:
    folder = tmp_path_factory.mktemp("torchtitan_config")
    (folder / "request.json").write_text(json.dumps(command_lines))
    run_reference_script("torchtitan_config_reference.py", folder / "request.json", folder / "answer.json", cwd=folder)
    return json.loads((folder / "answer.json").read_text())


def dtrain_value(cfg, key: str):
    section, name = key.rsplit(".", 1)
    value = getattr(section_of(cfg, section), name)
    return list(value) if isinstance(value, tuple) else value


def test_the_table_lists_exactly_torchtitans_keys(torchtitan):
    assert sorted(TORCHTITAN_V0_2_2_KEYS) == sorted(torchtitan["defaults"])
    assert set(TORCHTITAN_ONLY) | set(SHARED) == set(TORCHTITAN_V0_2_2_KEYS)
    assert set(SHARED) - set(SAME) == set(MEANING_DIFFERENCES)


def test_same_keys_have_torchtitans_defaults_unless_the_row_says_they_differ(torchtitan):
    ours = {key: spec.default for key, spec in config_fields().items()}
    for key in SHARED:
        theirs = torchtitan["defaults"][key]
        if key not in DEFAULT_DIFFERENCES:
            assert ours[key] == theirs or (theirs is None and ours[key] in UNSET), key
            continue
        # The row names torchtitan's default (as TOML, or "unset" for None) and dtrain's; they do differ.
        named = DEFAULT_DIFFERENCES[key][0]
        assert named.startswith("unset") if theirs is None else named == toml_value(theirs), key
        assert ours[key] != theirs, key


def explicitly_set(argv: list[str]) -> set[str]:
    """The keys a command line sets: through its TOML file or a flag."""
    data = tomllib.loads(Path(argv[1]).read_text())
    keys = set()

    def walk(table: dict, prefix: str) -> None:
        for name, value in table.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{name}.")
            else:
                keys.add(f"{prefix}{name}")

    walk(data, "")
    for flag in argv:
        if flag.startswith("--"):
            key = flag[2:].split("=")[0]
            section, _, name = key.rpartition(".")
            keys.add(f"{section}.{name.removeprefix('no_')}" if name.startswith("no_") else key)
    return keys


def test_both_parse_the_same_values_from_the_same_file_and_flags(torchtitan, command_lines):
    compared = collections.Counter()
    for argv, theirs in zip(command_lines, torchtitan["parsed"], strict=True):
        cfg = load_config(argv, env={})
        set_here = explicitly_set(argv)
        for key in SHARED:
            if key in DEFAULT_DIFFERENCES and key not in set_here:
                continue  # each side's own default: the test above
            ours = dtrain_value(cfg, key)
            expected = str(Path(theirs[key]).resolve()) if key == "job.config_file" else theirs[key]
            assert ours == expected or (expected is None and ours in UNSET), (Path(argv[1]).name, key)
            compared[key] += key in set_here
    # Every shared key was set (away from dtrain's default) at least once, and the flags did reach both parsers.
    assert sorted(key for key in SHARED if not compared[key]) == []
    first, last = torchtitan["parsed"][0], torchtitan["parsed"][-1]
    assert (first["training.steps"], first["metrics.enable_tensorboard"], first["checkpoint.enable"]) == (
        7, False, True)
    assert (last["training.steps"], last["checkpoint.enable"], last["debug.seed"]) == (9, False, 7)


NOTE = re.compile(r"(tests/[\w/]+\.py)(?:::(test_\w+))?")


@pytest.mark.parametrize("key", SHARED)
def test_every_row_of_a_shared_name_names_a_test_that_exists(key):
    notes = key_status(key)[1]
    assert key in PROVEN_SAME or key in TESTED_SAME or key in MEANING_DIFFERENCES, f"{key}: name its test"
    named = NOTE.findall(notes)
    assert named, notes
    for path, test in named:
        text = (REPO / path).read_text()
        assert not test or re.search(rf"^def {test}\(", text, re.M), f"{key}: {path}::{test} does not exist"


def test_gc_freq_and_init_timeout_reach_the_run(tmp_path, monkeypatch):
    """torchtitan's meaning: automatic GC off during training and a generation-1 collection every gc_freq steps
    (torchtitan.tools.utils.GarbageCollection: steps 2 and 4 of 5 for gc_freq 2); the process group is joined with
    comm.init_timeout_seconds."""
    import gc

    from dtrain.run import train as train_module
    from dtrain.run.prepare import prepare

    collections_, timeouts = [], []
    real_collect, real_init_world = gc.collect, train_module.init_world

    def collect(generation: int = 2) -> int:
        collections_.append((generation, gc.isenabled()))
        return real_collect(generation)

    def init_world(timeout_s: int):
        timeouts.append(timeout_s)
        return real_init_world(timeout_s)

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(train_module, "init_world", init_world)
    cfg = load_config([
        "--training.steps", "5", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32", "--training.gc_freq", "2", "--comm.init_timeout_seconds", "77",
        "--metrics.no_enable_tensorboard", "--job.dump_folder", str(tmp_path / "run"),
    ], env={})
    train_module.train(cfg, prepare(cfg))
    assert [c for c in collections_ if c[0] == 1] == [(1, False), (1, False)]
    assert timeouts == [77] and gc.isenabled()
