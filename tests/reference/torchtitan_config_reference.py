"""torchtitan 0.2.2's JobConfig: its defaults, and what its ConfigManager parses, in a process of its own.

    python torchtitan_config_reference.py REQUEST.json ANSWER.json

torchtitan's package imports its MoE kernels, which need triton, so it runs here behind the stand-in of
triton_stub.py and never in the pytest process. REQUEST.json is a list of command lines (each a list of arguments,
as `ConfigManager.parse_args` takes them); ANSWER.json holds `defaults` (every key of `JobConfig()`, flattened to
`section.key`) and `parsed` (the flattened JobConfig of each command line).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from triton_stub import install_triton_stub


def flatten(config, prefix: str = "") -> dict:
    """{"section.key": value} of a (nested) dataclass; tuples become lists (JSON has no tuple)."""
    flat = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            flat.update(flatten(value, f"{prefix}{field.name}."))
        else:
            flat[f"{prefix}{field.name}"] = list(value) if isinstance(value, tuple) else value
    return flat


def main(request_path: str, answer_path: str) -> None:
    install_triton_stub()
    from torchtitan.config.job_config import JobConfig
    from torchtitan.config.manager import ConfigManager

    with open(request_path) as f:
        command_lines = json.load(f)
    answer = {
        "defaults": flatten(JobConfig()),
        "parsed": [flatten(ConfigManager().parse_args(argv)) for argv in command_lines],
    }
    with open(answer_path, "w") as f:
        json.dump(answer, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
