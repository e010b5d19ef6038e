"""Sharding plans and mesh construction, installed as dtrain.parallelize; the only place that knows DTensor placements.

Typical use (the trainer's order; docs/parallelism.md, "How they compose"):

    spec = get_family(cfg.model.name)                                 # model family + its plan, by name
    dims = ParallelDims(world_size, dp_replicate, dp_shard, tp, ...)  # validates, before any process group
    spec.check_shapes(dims, args, seq_len)                            # TP divides heads, FFN, vocab, ...
    options = ParallelizeOptions(...); options.validate(dims)
    mesh = build_mesh(dims, device_type)                              # after init_process_group
    with torch.device("meta"): model = Transformer(args)
    reference = copy.deepcopy(model)                                  # meta: free
    spec.parallelize(model, mesh, dims, options); model.to_empty(device=device)
    init_weights_like_single_device(model, reference, seed)           # or init_weights_sharded on CUDA
    loss_fn = local_loss(cross_entropy_sum)                           # plain loss under loss parallel
    with loss_parallel_context(dims): forward, loss, backward
"""

from dtrain.parallelize.activation_checkpoint import SAC_SAVE_OPS, apply_ac
from dtrain.parallelize.compile import (
    apply_compile,
    check_compile_options,
    compile_debug_output,
    compile_kwargs,
    start_compile_trace,
    stop_compile_trace,
)
from dtrain.parallelize.data_parallel import apply_ddp, apply_fsdp
from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.families import FAMILIES, get_family
from dtrain.parallelize.family_spec import FamilySpec
from dtrain.parallelize.init import init_weights_like_single_device, init_weights_sharded, model_fqn
from dtrain.parallelize.memory import MemoryFootprint, local_shard, memory_footprint
from dtrain.parallelize.mesh import MESH_DIM_NAMES, ParallelMesh, build_mesh, fsdp_mesh
from dtrain.parallelize.options import ParallelizeOptions
from dtrain.parallelize.parallel_dims import ParallelDims
from dtrain.parallelize.tensor_parallel import (
    apply_tp,
    check_async_tp,
    enable_async_tp,
    format_tp_plan,
    local_loss,
    loss_parallel_context,
)

__all__ = [
    "FAMILIES",
    "FamilySpec",
    "MESH_DIM_NAMES",
    "SAC_SAVE_OPS",
    "MemoryFootprint",
    "ParallelDims",
    "ParallelMesh",
    "ParallelismError",
    "ParallelizeOptions",
    "apply_ac",
    "apply_compile",
    "check_compile_options",
    "compile_debug_output",
    "compile_kwargs",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
    "build_mesh",
    "check_async_tp",
    "enable_async_tp",
    "format_tp_plan",
    "fsdp_mesh",
    "get_family",
    "init_weights_like_single_device",
    "init_weights_sharded",
    "local_loss",
    "local_shard",
    "loss_parallel_context",
    "memory_footprint",
    "model_fqn",
    "start_compile_trace",
    "stop_compile_trace",
]
