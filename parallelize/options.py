"""How to parallelize beyond the degrees: precision, resharding, offload, activation checkpointing, compile.

Plain values mirroring the config keys, so that parallelize never needs the trainer's config objects. ``validate``
checks everything (also against the degrees) before any process group or model exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.parallelize.activation_checkpoint import check_memory_budget, parse_selective_option
from dtrain.parallelize.compile import check_compile_options
from dtrain.parallelize.context_parallel import cp_attention_path
from dtrain.parallelize.data_parallel import RESHARD_MODES, parse_dtype
from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.parallel_dims import ParallelDims
from dtrain.parallelize.tensor_parallel import check_async_tp


@dataclass(frozen=True)
class ParallelizeOptions:
    """Everything parallelize_* needs besides the mesh and the degrees (config key in brackets)."""

    device_type: str = "cpu"
    param_dtype: str = "float32"  # [training.mixed_precision_param], every layout
    reduce_dtype: str = "float32"  # [training.mixed_precision_reduce], FSDP and DDP
    reshard_after_forward: str = "default"  # [parallelism.fsdp_reshard_after_forward]
    cpu_offload: bool = False  # [training.enable_cpu_offload], FSDP only
    ac_mode: str = "none"  # [activation_checkpoint.mode]
    selective_ac_option: str = "2"  # [activation_checkpoint.selective_ac_option]
    memory_budget: float = 0.5  # [activation_checkpoint.memory_budget], for mode memory_budget
    compile_model: bool = False  # [compile.enable and "model" in compile.components]
    compile_backend: str = "inductor"  # [compile.backend]
    compile_mode: str = "default"  # [compile.mode]
    compile_fullgraph: bool = True  # [compile.fullgraph]
    compile_dynamic: str = "auto"  # [compile.dynamic]
    compile_granularity: str = "per_block"  # [compile.granularity]
    compile_trace_dir: str | None = None  # [<job.dump_folder>/<compile.trace_folder> when that is set]
    async_tp: bool = False  # [parallelism.enable_async_tensor_parallel]
    cp_load_balancer: str = "headtail"  # [parallelism.context_parallel_load_balancer]
    cp_rotate_method: str = "allgather"  # [parallelism.context_parallel_rotate_method]
    attention_mask: str = "causal"  # [training.attention_mask]
    attention_mask_backend: str = "auto"  # [training.attention_mask_backend]

    @property
    def flex_attention(self) -> bool:
        """Whether documents are masked through FlexAttention block masks (models/flex_attention.py): under
        block_causal, when asked for, or by default on CUDA (the dense mask stays the path elsewhere)."""
        if self.attention_mask != "block_causal":
            return False
        return self.attention_mask_backend == "flex" or (
            self.attention_mask_backend == "auto" and self.device_type == "cuda"
        )

    @property
    def cp_attention_path(self) -> str:
        """The attention a context-parallel rank runs here (context_parallel.py)."""
        return cp_attention_path(self.device_type, self.attention_mask, self.flex_attention)

    def validate(self, dims: ParallelDims) -> None:
        """Raise ParallelismError (one line, naming the key) for any invalid value or combination."""
        parse_dtype(self.param_dtype, "training.mixed_precision_param")
        parse_dtype(self.reduce_dtype, "training.mixed_precision_reduce")
        if self.reshard_after_forward not in RESHARD_MODES:
            raise ParallelismError(
                f"parallelism.fsdp_reshard_after_forward={self.reshard_after_forward!r} is invalid "
                f"(valid: {', '.join(RESHARD_MODES)})"
            )
        if self.attention_mask_backend == "flex" and self.device_type != "cuda":
            raise ParallelismError(
                f"training.attention_mask_backend='flex' needs CUDA (FlexAttention has no {self.device_type} "
                "backward); valid here: auto, dense"
            )
        parse_selective_option(self.ac_mode, self.selective_ac_option)
        check_memory_budget(self.ac_mode, self.memory_budget, self.compile_model, self.compile_backend)
        if self.cpu_offload and not dims.fsdp_enabled:
            raise ParallelismError(
                "training.enable_cpu_offload offloads FSDP shards and needs parallelism.data_parallel_shard_degree > 1"
            )
        if dims.cp_enabled and self.cp_rotate_method != "allgather" and self.cp_attention_path != "ring":
            raise ParallelismError(
                f"parallelism.context_parallel_rotate_method={self.cp_rotate_method!r} needs torch's ring attention "
                f"(CUDA, causal mask); context parallel on {self.device_type} with training.attention_mask="
                f"{self.attention_mask!r} all-gathers keys and values (valid: allgather)"
            )
        if self.compile_model:
            check_compile_options(
                self.compile_mode, self.compile_dynamic, self.compile_granularity, self.compile_backend,
                self.device_type, fullgraph=self.compile_fullgraph,
                data_parallel=dims.fsdp_enabled or dims.ddp_enabled,
            )
        check_async_tp(self.async_tp, tp=dims.tp, device_type=self.device_type, compile_model=self.compile_model)
