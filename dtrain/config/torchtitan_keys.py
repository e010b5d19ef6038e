"""torchtitan v0.2.2's config keys that dtrain has no field for, and what each means here.

A torchtitan TOML file loads unedited: every key of torchtitan v0.2.2's ``JobConfig`` is either a dtrain key of the
same name (``dtrain.config.schema``), or listed below. A listed key is

- renamed: its value goes to a dtrain key (``alias``);
- accepted where its value changes nothing here (``inert``: torchtitan's default, or every value for a key whose
  effect dtrain does not have at all); the run's log then names all such keys in one warning line;
- refused with any other value, in one line that says why (``reason``).

``TORCHTITAN_V0_2_2_KEYS`` lists every key of torchtitan v0.2.2 (its ``torchtitan/config/job_config.py``), for the
migration guide (scripts/gen_torchtitan_key_table.py writes docs/migrating-from-torchtitan.md's table from it).
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


_NO_FT = "torchft fault tolerance is not supported (dtrain restarts failed workers from checkpoints: MAX_RESTARTS)"
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
    "fault_tolerance.enable": ForeignKey((False,), _NO_FT),
    **{
        f"fault_tolerance.{name}": ForeignKey(reason="only matters with fault_tolerance.enable, which is refused")
        for name in (
            "process_group", "process_group_timeout_ms", "replica_id", "group_size", "min_replica_size",
            "semi_sync_method",
        )
    },
    "experimental.custom_import": ForeignKey(("",), _NO_PLUGINS),
    "experimental.custom_args_module": ForeignKey(("",), _NO_PLUGINS),
    "debug.moe_force_load_balance": ForeignKey((False,), "forcing balanced MoE routing is not built"),
}

# Converters torchtitan v0.2.2 registers that dtrain refuses, and why.
REFUSED_CONVERTERS = {
    "quantize.grouped_mm.float8": "float8 grouped GEMMs for MoE experts are not built (experts run in the compute dtype)",
    "quantize.grouped_mm.mx": "MXFP8 grouped GEMMs for MoE experts are not built (experts run in the compute dtype)",
}

# Where torchtitan v0.2.2 and dtrain default differently: key -> (torchtitan's default as a TOML value, or words when
# it has none; dtrain's default and why).
DEFAULT_DIFFERENCES = {
    "job.description": ('"default job"', "empty: nothing is claimed about a run that did not describe itself"),
    "model.hf_assets_path": (
        '"./tests/assets/tokenizer"', "empty: the built-in byte tokenizer, so that a bare run needs no files"
    ),
    "training.dataset": ('"c4_test"', "builtin: a corpus that needs no download"),
    "metrics.enable_tensorboard": ("false", "every run leaves a readable record"),
    "activation_checkpoint.mode": ('"selective"', "no recomputation unless asked for"),
    "optimizer.implementation": ('"fused"', "fused or foreach where the device has them, so CPU runs work"),
    "debug.seed": ("unset (a random seed)", "every run is reproducible unless the seed changes"),
    "quantize.linear.float8.recipe_name": ("unset (tensorwise)", "the same recipe, spelled out"),
    "quantize.linear.float8.filter_fqns": ("[]", "the head stays in high precision, as torchtitan's files set"),
    "quantize.linear.mx.recipe_name": (
        '"mxfp8_cublas"', "the name torchao 0.18 gives that recipe; mxfp8_cublas is refused"
    ),
    "validation.dataset": ('"c4_validation"', "the held-out part of the built-in corpus"),
}

# "Same" keys whose meaning a reference test checks against torchtitan v0.2.2's own code: key -> the note the
# migration guide shows (the test, and where the two still part, if anywhere).
_OPTIM_TEST = "tests/reference/test_torchtitan_optim_schedule.py"
PROVEN_SAME = {
    **{
        f"optimizer.{name}": f"{_OPTIM_TEST} (param groups, hyperparameters, weights after steps)"
        for name in ("name", "lr", "beta1", "beta2", "eps", "weight_decay")
    },
    "optimizer.implementation": f"{_OPTIM_TEST} (fused, foreach, for-loop)",
    **{
        f"lr_scheduler.{name}": f"{_OPTIM_TEST} (lr of every step)"
        for name in ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")
    },
    "lr_scheduler.total_steps": (
        f"{_OPTIM_TEST} (lr of every step); a run longer than total_steps holds the final rate, where torchtitan's "
        "decay runs on past it (below min_lr_factor)"
    ),
    "training.max_norm": (
        f"{_OPTIM_TEST} (norm and clipped gradients); `0` disables clipping here, where torchtitan would clip every "
        "gradient to zero"
    ),
}

TORCHTITAN_V0_2_2_KEYS = """
job.config_file job.dump_folder job.description job.print_config job.save_config_file job.custom_config_module
profiling.enable_profiling profiling.save_traces_folder profiling.profile_freq profiling.profiler_active
profiling.profiler_warmup profiling.enable_memory_snapshot profiling.save_memory_snapshot_folder
metrics.log_freq metrics.enable_tensorboard metrics.disable_color_printing metrics.save_tb_folder
metrics.save_for_all_ranks metrics.enable_wandb
model.name model.flavor model.hf_assets_path model.tokenizer_path model.converters model.print_after_conversion
optimizer.name optimizer.lr optimizer.beta1 optimizer.beta2 optimizer.eps optimizer.weight_decay
optimizer.implementation optimizer.early_step_in_backward
lr_scheduler.warmup_steps lr_scheduler.total_steps lr_scheduler.decay_ratio lr_scheduler.decay_type
lr_scheduler.min_lr_factor
training.dataset training.dataset_path training.local_batch_size training.global_batch_size training.seq_len
training.max_norm training.steps training.enable_cpu_offload training.dtype training.mixed_precision_param
training.mixed_precision_reduce training.gc_freq training.gc_debug training.dataloader.num_workers
training.dataloader.persistent_workers training.dataloader.pin_memory training.dataloader.prefetch_factor
parallelism.data_parallel_replicate_degree parallelism.data_parallel_shard_degree
parallelism.fsdp_reshard_after_forward parallelism.tensor_parallel_degree parallelism.disable_loss_parallel
parallelism.enable_async_tensor_parallel parallelism.pipeline_parallel_degree parallelism.module_fqns_per_model_part
parallelism.pipeline_parallel_first_stage_less_layers parallelism.pipeline_parallel_last_stage_less_layers
parallelism.pipeline_parallel_layers_per_stage parallelism.pipeline_parallel_schedule
parallelism.pipeline_parallel_schedule_csv parallelism.pipeline_parallel_microbatch_size
parallelism.pipeline_parallel_expert_parallel_overlap parallelism.context_parallel_degree
parallelism.context_parallel_load_balancer parallelism.context_parallel_rotate_method
parallelism.expert_parallel_degree parallelism.expert_tensor_parallel_degree parallelism.expert_parallel_comm_backend
checkpoint.enable checkpoint.enable_ft_dataloader_checkpoints checkpoint.folder checkpoint.interval
checkpoint.initial_load_path checkpoint.initial_load_model_only checkpoint.initial_load_in_hf
checkpoint.initial_load_in_hf_quantized checkpoint.last_save_model_only checkpoint.last_save_in_hf
checkpoint.export_dtype checkpoint.async_mode checkpoint.keep_latest_k checkpoint.load_step
checkpoint.exclude_from_loading checkpoint.enable_first_step_checkpoint checkpoint.create_seed_checkpoint
checkpoint.load_only
activation_checkpoint.mode activation_checkpoint.selective_ac_option
activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns activation_checkpoint.early_stop
activation_checkpoint.memory_budget activation_checkpoint.visualize_memory_budget_pareto
activation_checkpoint.preserve_rng_state activation_checkpoint.determinism_check activation_checkpoint.debug
compile.enable compile.components compile.backend
quantize.linear.float8.enable_fsdp_float8_all_gather quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp
quantize.linear.float8.recipe_name quantize.linear.float8.filter_fqns quantize.linear.float8.emulate
quantize.linear.mx.mxfp8_dim1_cast_kernel_choice quantize.linear.mx.recipe_name quantize.linear.mx.filter_fqns
quantize.grouped_mm.float8.fqns quantize.grouped_mm.mx.recipe_name quantize.grouped_mm.mx.fqns
comm.init_timeout_seconds comm.train_timeout_seconds comm.trace_buf_size comm.save_traces_folder
comm.save_traces_file_prefix comm.mode
memory_estimation.enable memory_estimation.disable_fake_mode
fault_tolerance.enable fault_tolerance.process_group fault_tolerance.process_group_timeout_ms
fault_tolerance.replica_id fault_tolerance.group_size fault_tolerance.min_replica_size
fault_tolerance.semi_sync_method
experimental.custom_import experimental.custom_args_module
validation.enable validation.dataset validation.dataset_path validation.local_batch_size validation.seq_len
validation.freq validation.steps validation.dataloader.num_workers validation.dataloader.persistent_workers
validation.dataloader.pin_memory validation.dataloader.prefetch_factor
debug.seed debug.deterministic debug.deterministic_warn_only debug.moe_force_load_balance
""".split()


def foreign_sections() -> set[str]:
    """The sections (and nested sections) that hold a listed key, e.g. ``fault_tolerance``, ``quantize.grouped_mm``."""
    found = set()
    for key in TORCHTITAN_ONLY:
        parts = key.split(".")[:-1]
        found.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return found
