"""torchtitan v0.2.2's config keys that dtrain has no field for, and what each means here.

A torchtitan TOML file loads unedited: every key of torchtitan v0.2.2's ``JobConfig`` is either a dtrain key of the
same name (``dtrain.config.schema``), or listed below. A listed key is

- renamed: its value goes to a dtrain key (``alias``);
- accepted where its value changes nothing here (``inert``: torchtitan's default, or every value for a key whose
  effect dtrain does not have at all); the run's log then names all such keys in one warning line;
- refused with any other value, in one line that says why (``reason``).

What the keys dtrain shares with torchtitan default to and mean, for the migration guide, is in
torchtitan_comparison.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Any value of the key is inert.
ANY = object()


@dataclass(frozen=True)
class ForeignKey:
    """A torchtitan key without a dtrain field: which values are inert here, and why the others are refused."""

    inert: tuple[Any, ...] = (ANY,)
    reason: str = ""  # why other values are refused; for a key inert at any value, why it changes nothing
    alias: str | None = None  # the dtrain key that takes the value instead

    def accepts(self, value: Any) -> bool:
        return self.alias is not None or ANY in self.inert or value in self.inert


_NO_PLUGINS = "dtrain does not import user modules into its config or model registry (families live in parallelize/families.py)"
_NO_DRY_RUN = "simulated-world dry runs are not built; dtrain checks per-rank memory before every run (training.skip_memory_check)"
_GROUPED_MM = "only matters with its converter in model.converters, which is refused (grouped GEMMs run unconverted)"
_AC_SAVE_ALL_MM = "dtrain's op-level activation checkpointing keeps every matmul output; it has no per-module exceptions"

TORCHTITAN_ONLY: dict[str, ForeignKey] = {
    "job.custom_config_module": ForeignKey(("",), _NO_PLUGINS),
    "model.tokenizer_path": ForeignKey(alias="model.hf_assets_path"),
    "model.print_after_conversion": ForeignKey((False,), "printing the model after conversion is not built"),
    "optimizer.early_step_in_backward": ForeignKey(
        (False,), "stepping the optimizer inside backward (per-parameter hooks) is not built"
    ),
    "training.dtype": ForeignKey(
        ("float32",),
        "pure low-precision training is not built: parameters and optimizer state stay float32 and compute runs in "
        "training.mixed_precision_param",
    ),
    "training.gc_debug": ForeignKey((False,), "garbage-collection debugging is not built (training.gc_freq is)"),
    "parallelism.pipeline_parallel_first_stage_less_layers": ForeignKey(
        (1,),
        "dtrain's even split counts the embedding as one layer (torchtitan's 1); for another split set "
        "parallelism.module_fqns_per_model_part",
    ),
    "parallelism.pipeline_parallel_last_stage_less_layers": ForeignKey(
        (1,),
        "dtrain's even split counts the head as one layer (torchtitan's 1); for another split set "
        "parallelism.module_fqns_per_model_part",
    ),
    "parallelism.pipeline_parallel_schedule_csv": ForeignKey(
        ("",), "schedules read from CSV files are not supported; choose parallelism.pipeline_parallel_schedule"
    ),
    "parallelism.pipeline_parallel_expert_parallel_overlap": ForeignKey(
        reason="dtrain's DualPipeV never overlaps expert-parallel communication, whichever value"
    ),
    "parallelism.expert_parallel_comm_backend": ForeignKey(
        ("standard",), "DeepEP is not supported; expert parallel exchanges tokens with torch's all_to_all_single"
    ),
    "checkpoint.enable_ft_dataloader_checkpoints": ForeignKey(reason="only matters with fault tolerance"),
    "checkpoint.initial_load_in_hf_quantized": ForeignKey(
        (False,), "loading quantized Hugging Face checkpoints is not supported"
    ),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": ForeignKey(
        (["moe.router.gate"], []), _AC_SAVE_ALL_MM
    ),
    "activation_checkpoint.early_stop": ForeignKey((False,), "stopping recomputation early is not built"),
    "activation_checkpoint.visualize_memory_budget_pareto": ForeignKey(
        (False,), "plotting the memory-budget Pareto front is not built"
    ),
    "activation_checkpoint.preserve_rng_state": ForeignKey(
        (True,), "recomputation always replays the forward's random state here"
    ),
    "activation_checkpoint.determinism_check": ForeignKey(
        ("default",), "only torch's default recomputation check is used"
    ),
    "activation_checkpoint.debug": ForeignKey((False,), "activation checkpointing debug output is not built"),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": ForeignKey(
        ("triton",), "dtrain uses the kernels of torchao's MX recipe (quantize.linear.mx.recipe_name)"
    ),
    "quantize.grouped_mm.float8.fqns": ForeignKey(reason=_GROUPED_MM),
    "quantize.grouped_mm.mx.recipe_name": ForeignKey(reason=_GROUPED_MM),
    "quantize.grouped_mm.mx.fqns": ForeignKey(reason=_GROUPED_MM),
    "comm.trace_buf_size": ForeignKey((20000, 0), "NCCL flight-recorder dumps are not built"),
    "comm.save_traces_folder": ForeignKey(reason="flight-recorder dumps are not built, so nothing is written there"),
    "comm.save_traces_file_prefix": ForeignKey(
        reason="flight-recorder dumps are not built, so nothing is written there"
    ),
    "comm.mode": ForeignKey(("default",), _NO_DRY_RUN),
    "memory_estimation.enable": ForeignKey((False,), _NO_DRY_RUN),
    "memory_estimation.disable_fake_mode": ForeignKey(reason="only matters with memory_estimation.enable"),
    "experimental.custom_import": ForeignKey(("",), _NO_PLUGINS),
    "experimental.custom_args_module": ForeignKey(("",), _NO_PLUGINS),
    "debug.moe_force_load_balance": ForeignKey((False,), "forcing balanced MoE routing is not built"),
}

# Converters torchtitan v0.2.2 registers that dtrain refuses, and why.
REFUSED_CONVERTERS = {
    "quantize.grouped_mm.float8": "float8 grouped GEMMs for MoE experts are not built (experts run in the compute dtype)",
    "quantize.grouped_mm.mx": "MXFP8 grouped GEMMs for MoE experts are not built (experts run in the compute dtype)",
}

def foreign_sections() -> set[str]:
    """The sections (and nested sections) that hold a listed key, e.g. ``fault_tolerance``, ``quantize.grouped_mm``."""
    found = set()
    for key in TORCHTITAN_ONLY:
        parts = key.split(".")[:-1]
        found.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return found
