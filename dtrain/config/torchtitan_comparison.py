"""How the keys dtrain shares with torchtitan v0.2.2 compare, for the migration guide's table (torchtitan_table.py;
scripts/gen_config_docs.py writes it into docs/migrating-from-torchtitan.md): the defaults that differ, the meanings
a reference test proves the same or that differ, the tests that show a key behaves alike, and
``TORCHTITAN_V0_2_2_KEYS``, every key of torchtitan v0.2.2 (its ``torchtitan/config/job_config.py``).
"""

from __future__ import annotations

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
    "checkpoint.last_save_model_only": (
        "true", "a finished run continues from its last step when rerun with more steps; true for a weights-only export"
    ),
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
    "model.flavor": (
        "tests/reference/test_torchtitan_flavors.py (every args field of every Llama 3, Qwen3 and DeepSeek-V3 "
        "flavor; DeepSeek-V3 debugmodel logits) and tests/reference/test_torchtitan_init.py (each weight's init "
        "distribution); the block-causal mask of the `*_flex*`/`*_varlen*` flavors is `training.attention_mask` "
        "here; dtrain adds `debugmodel_gqa` (its default run's), `debugmodel_moe_small`, `debugmodel_small`, `1B`, "
        "`3B` (docs/models.md)"
    ),
}

# Keys of torchtitan's name whose meaning differs here after all: key -> what differs (the guide's row says so).
MEANING_DIFFERENCES = {
    "fault_tolerance.semi_sync_method": (
        "torchft's local_sgd and diloco as in torchtitan, but synchronous training is `\"\"` (TOML has no None), "
        "and the sync interval and DiLoCo's outer SGD are keys here (fault_tolerance.sync_steps, outer_lr, "
        "outer_momentum); tests/fault_tolerance/test_semi_sync.py"
    ),
    "job.print_config": (
        "prints the resolved config as TOML and exits without training (tests/e2e/test_run_train_cli.py::"
        "test_help_and_print_config_answer_without_training); torchtitan logs it as JSON and trains"
    ),
}

# The other "same" keys: key -> the note the guide shows, naming the dtrain test that exercises the key's torchtitan
# meaning (path::test, or a parity file and its layout), and where the two part, if anywhere.
# tests/reference/test_torchtitan_config_keys.py checks that each named test exists.
_PARSED = "tests/reference/test_torchtitan_config_keys.py::test_both_parse_the_same_values_from_the_same_file_and_flags"
_TRAINS = "tests/reference/test_torchtitan_training.py::test_torchtitan_toml_trains_torchtitans_curve"
_PROFILE = "tests/observe/test_profiling.py::test_profiler_writes_traces_at_the_end_of_each_window"
_SNAPSHOT = "tests/observe/test_profiling.py::test_memory_snapshot_dumps_every_profile_freq_steps_on_cuda (CUDA)"
_BACKGROUND = "tests/data/test_data_background.py::test_every_setting_gives_the_same_batches_and_state"
_VALIDATOR = "tests/run/test_validation.py::test_validator_runs_its_batches_and_reports_perplexity"
_VALIDATION_LOADER = (
    "tests/run/test_validation.py::"
    "test_background_loading_reads_the_same_batches_at_every_evaluation"
)
_FLOAT8 = "tests/parallelize/test_float8.py::test_converts_the_linears_that_fit_and_are_not_filtered"
_FLOAT8_FSDP = "tests/parallelize/test_float8.py::test_precompute_hook_only_with_fsdp_float8_all_gather"
_MX = "tests/parallelize/test_mx.py::test_converts_the_linears_that_fit_the_mx_block_and_are_not_filtered"
_COMPILED_RUN = (
    "tests/observe/test_compile_report.py::"
    "test_the_trainer_writes_the_report_logs_it_once_and_dumps_inductor_code_of_the_first_step"
)
_DETERMINISM = "tests/step/test_step.py::test_deterministic_warn_only_warns_instead_of_raising"
_FT_PARITY = (
    "tests/fault_tolerance/test_ft_layout_parity.py::test_replica_groups_train_the_curve_of_their_layout_replicated"
)
TESTED_SAME = {
    **{
        f"fault_tolerance.{name}": _FT_PARITY
        for name in ("enable", "process_group", "replica_id", "group_size", "min_replica_size")
    },
    "fault_tolerance.process_group_timeout_ms": (
        "tests/fault_tolerance/test_replica_recovery.py::"
        "test_a_killed_group_is_relaunched_recovers_live_and_ends_with_the_survivors_weights"
    ),
    "job.config_file": "tests/config/test_config_resolution.py::test_existing_path_is_used_as_is",
    "job.dump_folder": "tests/e2e/test_run_train_cli.py::test_debug_model_trains_writes_outputs_and_is_deterministic",
    "job.description": f"{_PARSED} (a label only, in both)",
    "job.save_config_file": (
        "tests/config/test_torchtitan_drop_in.py::test_save_config_file_writes_the_resolved_config_as_json (dtrain's "
        "keys); a path outside job.dump_folder is refused here"
    ),
    "profiling.enable_profiling": f"{_PROFILE} (iteration_<step>/rank<r>_trace.json, torchtitan's layout)",
    "profiling.save_traces_folder": f"{_PROFILE} (under job.dump_folder)",
    "profiling.profile_freq": f"{_PROFILE} (a window ends at each multiple)",
    "profiling.profiler_active": f"{_PROFILE} (recorded steps of a window)",
    "profiling.profiler_warmup": f"{_PROFILE} (warmup steps before them)",
    "profiling.enable_memory_snapshot": f"{_SNAPSHOT}; refused on a CPU-only machine",
    "profiling.save_memory_snapshot_folder": _SNAPSHOT,
    "metrics.log_freq": (
        "tests/metrics/test_metrics_logger.py::test_should_log_first_every_log_freq_and_last_step (step 1 and every "
        "log_freq-th); the last step is logged too here"
    ),
    "metrics.enable_tensorboard": (
        "tests/metrics/test_metrics_logger.py::"
        "test_tensorboard_events_are_written_and_readable"
    ),
    "metrics.disable_color_printing": (
        "tests/metrics/test_metrics_color.py::"
        "test_disable_color_printing_keeps_a_terminal_plain"
    ),
    "metrics.save_tb_folder": "tests/metrics/test_metrics_logger.py::test_tensorboard_events_are_written_and_readable",
    "metrics.save_for_all_ranks": (
        "tests/metrics/test_metrics_logger.py::test_save_for_all_ranks_gives_each_rank_its_own_files"
    ),
    "metrics.enable_wandb": (
        "tests/metrics/test_metrics_wandb.py::"
        "test_rank0_logs_every_record_to_a_wandb_run_with_the_config"
    ),
    "model.name": f"{_TRAINS} (the Llama 3 and Qwen3 families)",
    "model.hf_assets_path": (
        "tests/data/test_data_tokenizer_config.py::test_bos_eos_come_from_tokenizer_config_at_the_next_free_ids (a "
        "folder laid out as torchtitan's)"
    ),
    "model.converters": f"{_FLOAT8} and {_MX}",
    "training.dataset": "tests/data/test_data_c4.py::test_c4_test_is_the_first_2000_training_documents",
    "training.dataset_path": "tests/data/test_data_sources.py::test_c4_default_path_and_missing_paths",
    "training.local_batch_size": _TRAINS,
    "training.global_batch_size": (
        "tests/e2e/test_run_train_cli.py::test_gradient_accumulation_matches_one_big_microbatch (the steps it "
        "accumulates)"
    ),
    "training.seq_len": _TRAINS,
    "training.steps": _TRAINS,
    "training.enable_cpu_offload": "tests/parallelize/test_parity_fsdp_ddp.py (layout fsdp_reshard_never_cpu_offload)",
    "training.mixed_precision_param": "tests/parallelize/test_parity_precision.py (the bf16 layouts)",
    "training.mixed_precision_reduce": "tests/parallelize/test_parity_precision.py (layout ddp_bf16_reduce_bf16)",
    "training.gc_freq": "tests/reference/test_torchtitan_config_keys.py::test_gc_freq_and_init_timeout_reach_the_run",
    "training.dataloader.num_workers": _BACKGROUND,
    "training.dataloader.persistent_workers": (
        "tests/data/test_data_background.py::test_persistent_workers_survive_a_rewind"
    ),
    "training.dataloader.pin_memory": "tests/data/test_data_background.py::test_pin_memory_without_cuda_does_nothing",
    "training.dataloader.prefetch_factor": _BACKGROUND,
    "parallelism.data_parallel_replicate_degree": (
        "tests/parallelize/test_parity_hsdp.py::"
        "test_hsdp_shards_within_replicas"
    ),
    "parallelism.data_parallel_shard_degree": (
        "tests/parallelize/test_parallel_dims.py::test_shard_degree_minus_one_takes_the_rest"
    ),
    "parallelism.fsdp_reshard_after_forward": (
        "tests/parallelize/test_parity_fsdp_ddp.py (layouts fsdp_reshard_always, fsdp_reshard_never_cpu_offload); "
        "`default` keeps the last block gathered and reshards under pipeline parallel too, where torchtitan's "
        "reshards every block but none under pipeline parallel (memory and speed only)"
    ),
    "parallelism.tensor_parallel_degree": "tests/parallelize/test_parity_tp.py::test_every_parameter_is_a_tp_dtensor",
    "parallelism.disable_loss_parallel": "tests/parallelize/test_parity_tp.py (layout tp_no_loss_parallel)",
    "parallelism.enable_async_tensor_parallel": (
        "tests/parallelize/test_cuda.py::"
        "test_async_tp_enables_micro_pipelining"
    ),
    "parallelism.pipeline_parallel_degree": (
        "tests/e2e/test_run_train_pipeline.py::test_pipeline_reproduces_the_single_process_losses"
    ),
    "parallelism.module_fqns_per_model_part": (
        "tests/config/test_config_nested_lists.py::test_nested_toml_lists_as_torchtitan_writes_them; an empty list "
        "is unset here (torchtitan's None)"
    ),
    "parallelism.pipeline_parallel_layers_per_stage": (
        "tests/parallelize/test_pipeline_plan.py::test_layers_per_stage_sets_the_number_of_stages"
    ),
    "parallelism.pipeline_parallel_schedule": (
        "tests/parallelize/test_pipeline_parity.py::test_schedule_matches_single_process"
    ),
    "parallelism.pipeline_parallel_microbatch_size": (
        "tests/e2e/test_run_train_pipeline.py::test_pipeline_reproduces_the_single_process_losses"
    ),
    "parallelism.context_parallel_degree": (
        "tests/parallelize/test_parity_cp.py::test_parameters_are_sharded_over_the_cp_ranks"
    ),
    "parallelism.context_parallel_load_balancer": (
        "tests/parallelize/test_context_parallel.py::test_headtail_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i; "
        "`none` spells torchtitan's None (which TOML cannot write); `ptrr` (FlexAttention) is refused"
    ),
    "parallelism.context_parallel_rotate_method": (
        "tests/parallelize/test_context_parallel.py::test_alltoall_rotation_is_valid_only_on_torchs_ring"
    ),
    "parallelism.expert_parallel_degree": (
        "tests/e2e/test_run_train_moe.py::test_expert_parallel_over_two_processes_matches_one"
    ),
    "parallelism.expert_tensor_parallel_degree": (
        "tests/config/test_config_validate.py::test_invalid_configs; only `1` (every TP rank keeps whole experts)"
    ),
    "checkpoint.enable": "tests/checkpoint/test_checkpoint_export.py::test_disabled_checkpointing_saves_nothing",
    "checkpoint.folder": (
        "tests/checkpoint/test_checkpoint_save_policy.py::test_first_step_checkpoint_saves_the_full_state_after_step_1"
    ),
    "checkpoint.interval": "tests/checkpoint/test_checkpoint_resume.py::test_retention_keeps_the_newest_k",
    "checkpoint.initial_load_path": (
        "tests/reference/test_torchtitan_checkpoints.py::test_a_torchtitan_checkpoint_gives_torchtitans_logits"
    ),
    "checkpoint.initial_load_model_only": (
        "tests/checkpoint/test_checkpoint_startup.py::"
        "test_initial_load_takes_weights_by_default_and_the_full_state_on_request"
    ),
    "checkpoint.initial_load_in_hf": (
        "tests/reference/test_transformers_roundtrip.py::test_hf_folder_trains_exports_and_generates_as_transformers"
    ),
    "checkpoint.last_save_model_only": (
        "tests/checkpoint/test_checkpoint_export.py::"
        "test_last_save_is_model_only_in_export_dtype_and_loads_with_plain_torch"
    ),
    "checkpoint.last_save_in_hf": (
        "tests/checkpoint/test_checkpoint_last_save_hf.py::test_final_save_is_a_hugging_face_folder_that_loads_back"
    ),
    "checkpoint.export_dtype": (
        "tests/checkpoint/test_checkpoint_last_save_hf.py::"
        "test_float16_export_of_hf_and_model_only_saves"
    ),
    "checkpoint.async_mode": (
        "tests/checkpoint/test_checkpoint_resume.py::"
        "test_resume_after_a_crash_continues_bit_identically"
    ),
    "checkpoint.keep_latest_k": (
        "tests/checkpoint/test_checkpoint_resume.py::test_retention_keeps_the_newest_k; `1` keeps one checkpoint "
        "here, where torchtitan refuses it"
    ),
    "checkpoint.load_step": (
        "tests/checkpoint/test_checkpoint_startup.py::test_load_step_picks_a_step_and_names_the_available_ones"
    ),
    "checkpoint.exclude_from_loading": (
        "tests/checkpoint/test_checkpoint_startup.py::test_excluded_parts_start_fresh; `optimizer`, `lr_scheduler`, "
        "`dataloader` (torchtitan's `model` and `train_state` are refused)"
    ),
    "checkpoint.enable_first_step_checkpoint": (
        "tests/checkpoint/test_checkpoint_save_policy.py::test_first_step_checkpoint_saves_the_full_state_after_step_1"
    ),
    "checkpoint.create_seed_checkpoint": (
        "tests/checkpoint/test_checkpoint_resume.py::"
        "test_seed_checkpoint_gives_the_same_run_as_the_initialisation_it_saved"
    ),
    "checkpoint.load_only": "tests/checkpoint/test_checkpoint_save_policy.py::test_load_only_resumes_and_never_saves",
    "activation_checkpoint.mode": (
        "tests/parallelize/test_single_process.py::"
        "test_what_each_ac_mode_recomputes_in_backward"
    ),
    "activation_checkpoint.selective_ac_option": (
        "tests/parallelize/test_single_process.py::test_every_nth_block_is_wrapped_counting_from_one"
    ),
    "activation_checkpoint.memory_budget": (
        "tests/parallelize/test_single_process.py::test_memory_budget_trades_kept_activations_for_recomputation_exactly"
    ),
    "compile.enable": _COMPILED_RUN,
    "compile.components": f"{_COMPILED_RUN} (the default: model and loss)",
    "compile.backend": "tests/parallelize/test_compile_options.py::test_config_values_become_torch_compile_arguments",
    "quantize.linear.float8.enable_fsdp_float8_all_gather": _FLOAT8_FSDP,
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": _FLOAT8_FSDP,
    "quantize.linear.float8.recipe_name": "tests/parallelize/test_float8.py::test_float8_loss_tracks_the_fp32_loss",
    "quantize.linear.float8.filter_fqns": _FLOAT8,
    "quantize.linear.float8.emulate": _FLOAT8,
    "quantize.linear.mx.recipe_name": "tests/parallelize/test_mx.py::test_mx_loss_tracks_the_fp32_loss",
    "quantize.linear.mx.filter_fqns": _MX,
    "comm.init_timeout_seconds": (
        "tests/reference/test_torchtitan_config_keys.py::test_gc_freq_and_init_timeout_reach_the_run"
    ),
    "comm.train_timeout_seconds": (
        "tests/parallelize/test_collective_timeout.py::test_a_silent_peer_times_out_at_the_lowered_timeout"
    ),
    "validation.enable": "tests/e2e/test_run_train_validation.py::test_pipeline_run_validates_every_freq_steps",
    "validation.dataset": "tests/data/test_data_c4.py::test_c4_validation_reads_the_validation_split_only",
    "validation.dataset_path": "tests/run/test_validation.py::test_a_files_side_depends_on_its_path_alone",
    "validation.local_batch_size": _VALIDATOR,
    "validation.seq_len": _VALIDATOR,
    "validation.freq": "tests/e2e/test_run_train_validation.py::test_pipeline_run_validates_every_freq_steps",
    "validation.steps": (
        f"{_VALIDATOR}; -1: tests/run/test_validation.py::"
        "test_steps_minus_one_counts_the_whole_set_in_full_global_batches"
    ),
    "validation.dataloader.num_workers": _VALIDATION_LOADER,
    "validation.dataloader.persistent_workers": _VALIDATION_LOADER,
    "validation.dataloader.pin_memory": "tests/data/test_data_background.py::test_pin_memory_without_cuda_does_nothing",
    "validation.dataloader.prefetch_factor": _BACKGROUND,
    "debug.seed": (
        "tests/e2e/test_run_train_cli.py::test_debug_model_trains_writes_outputs_and_is_deterministic; the same seed "
        "draws other random numbers than torchtitan's (tests/reference/test_torchtitan_init.py: the same distributions)"
    ),
    "debug.deterministic": _DETERMINISM,
    "debug.deterministic_warn_only": _DETERMINISM,
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
