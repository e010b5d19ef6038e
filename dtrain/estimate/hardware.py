"""Hardware profiles for the estimator: peak FLOP/s per dtype, device memory, bandwidth within and between nodes.

Profiles are data files, `hardware/<name>.toml`, each with its sources in its comments. `matmul_efficiency` is the
one fitted number: the fraction of peak a step's compute reaches (docs/planning.md says on what it was fitted and
the error on other runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dtrain.config.toml_io import tomllib
from dtrain.errors import ConfigError

PROFILES = Path(__file__).parent / "hardware"


def profile_names() -> list[str]:
    return sorted(path.stem for path in PROFILES.glob("*.toml"))


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    gpus_per_node: int  # devices (processes) per node: groups within one node use nvlink_gbps
    memory_gib: float
    nvlink_gbps: float  # GB/s per device per direction within a node
    network_gbps: float  # GB/s per device per direction between nodes
    matmul_efficiency: float
    peak_tflops: dict[str, float]

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in `dtype` (a torch dtype name: bfloat16, float32, ...)."""
        if dtype not in self.peak_tflops:
            raise ConfigError(
                f"--hardware {self.name} has no {dtype} peak (has {', '.join(self.peak_tflops)}); choose another "
                "training.mixed_precision_param or hardware"
            )
        return self.peak_tflops[dtype] * 1e12

    def bandwidth(self, intra_node: bool) -> float:
        """Bytes per second per device per direction for a group inside one node, or one that spans nodes."""
        return (self.nvlink_gbps if intra_node else self.network_gbps) * 1e9


def load_hardware(name: str) -> Hardware:
    path = PROFILES / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"--hardware {name!r} is not a profile; valid: {', '.join(profile_names())}")
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return Hardware(**data)
