"""The shared decoder's parallelization: the fixed order in which every layer is applied, for any family, and the
tensor-parallel plan of the shared pre-norm decoder (models/transformer.py) around a family's attention.

Order (torchtitan's, and each step depends on the previous ones):
1. tensor (+ sequence, + loss) parallel: the family's plan (``decoder_tp_plan`` for the shared decoder; torchao's
   float8 styles for float8 linears, float8_tp.py; LoRA's for LoRA linears, lora_parallel.py); parameters become
   DTensors on the ``tp`` mesh; then context parallel and expert parallel (expert_parallel.py), which change what
   attention and the MoE layers exchange (without context parallel, document masking through FlexAttention swaps
   the inner attention here instead: models/flex_attention.py);
2. activation checkpointing of blocks (wraps each block, so it must see the TP'd block);
3. ``torch.compile`` per block (compiles the TP'd, checkpointed block as one graph), or of the whole model part
   (``compile.granularity = model_whole``);
4. data parallel last: FSDP2 / HSDP (``fully_shard`` adds the ``dp`` dimension to the TP DTensors, and computes in
   the run's dtype by its mixed-precision policy) or, without FSDP, the forward under autocast to that dtype and
   DDP where there are replicas (mixed_precision.py).
"""

from __future__ import annotations

from typing import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from dtrain.models.decoder import DecoderArgs, decoder_layout
from dtrain.models.flex_attention import use_flex_document_attention
from dtrain.models.transformer import Transformer
from dtrain.parallelize.activation_checkpoint import apply_ac, set_memory_budget
from dtrain.parallelize.compile import apply_compile, start_compile_trace
from dtrain.parallelize.context_parallel import apply_cp
from dtrain.parallelize.data_parallel import apply_ddp, apply_fsdp, parse_dtype
from dtrain.parallelize.errors import ParallelismError
from dtrain.parallelize.expert_parallel import apply_ep
from dtrain.parallelize.float8_tp import float8_tp_plan
from dtrain.parallelize.lora_parallel import lora_tp_plan
from dtrain.parallelize.mesh import ParallelMesh, fsdp_mesh
from dtrain.parallelize.mixed_precision import autocast_forward, reduce_ddp_gradients_in
from dtrain.parallelize.moe_hooks import reduce_expert_loads_over
from dtrain.parallelize.moe_tensor_parallel import moe_tp_plan, without_routed_experts
from dtrain.parallelize.options import ParallelizeOptions
from dtrain.parallelize.parallel_dims import ParallelDims
from dtrain.parallelize.tensor_parallel import (
    ReplicateParallel,
    SyncOutputRowwiseParallel,
    TPPlan,
    apply_tp,
    enable_async_tp,
    resolve_plan,
)


def grouped_query_projections() -> TPPlan:
    """The shared decoder's grouped-query attention for ``decoder_tp_plan``: wq/wk/wv split by output features,
    whole query and kv heads per rank."""
    return {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel()}


def decoder_tp_plan(attention_styles: TPPlan, *, sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    """The Megatron plan of the shared decoder around a family's attention styles (`attention_styles`: paths below a
    block's ``attention``, e.g. Llama's ``wq``; the output projection ``wo`` is added here).

    In each block the attention's head projections and w1/w3 are split by output features (whole heads / hidden
    units per rank) and wo/w2 by input features, so attention and the FFN need one reduction each. With sequence
    parallel, the activations between those regions (norms, residual stream) are split along the sequence instead
    of replicated: the reduction becomes a reduce-scatter and the next region starts with an all-gather, for the
    same traffic and 1/tp of the activation memory. The embedding is split by vocabulary rows and the head by
    vocabulary columns; with loss parallel the logits stay vocab-sharded into the cross-entropy.

    A MoE block (models/moe.py) has ``moe`` where a dense block has ``feed_forward`` (``resolve_plan`` keeps the
    paths each block has); its plan is moe_tensor_parallel.py's: shared experts split like the dense feed-forward,
    router and routed experts whole on every TP rank, on the whole sequence.
    """
    seq = Shard(1)
    act = seq if sequence_parallel else Replicate()
    norm_style = SequenceParallel if sequence_parallel else ReplicateParallel
    # With sequence parallel each region gathers the sequence once at its entry (the RoPE table, the positions and
    # the document ids, attention's other inputs, are whole on every rank and stay plain tensors). Without it,
    # activations arrive replicated and need no preparation.
    gather_attention_input = PrepareModuleInput(
        input_layouts=(seq, None, None, None), desired_input_layouts=(Replicate(), None, None, None)
    )
    gather_ffn_input = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    # Names from the shared decoder's layout; those inside a block (its norms and feed-forward) are the shared
    # block's own, which this plan is the plan of.
    d = Transformer.decoder_layout
    block, attention = f"{d.blocks}.*", f"{d.blocks}.*.{d.attention}"
    return {
        d.embedding: SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        f"{block}.attention_norm": norm_style(),
        **({attention: gather_attention_input} if sequence_parallel else {}),
        **{f"{attention}.{path}": style for path, style in attention_styles.items()},
        f"{attention}.wo": RowwiseParallel(output_layouts=act),
        f"{block}.ffn_norm": norm_style(),
        **({f"{block}.feed_forward": gather_ffn_input} if sequence_parallel else {}),
        f"{block}.feed_forward.w1": ColwiseParallel(),
        f"{block}.feed_forward.w3": ColwiseParallel(),
        f"{block}.feed_forward.w2": RowwiseParallel(output_layouts=act),
        **{f"{block}.{path}": style for path, style in moe_tp_plan(sequence_parallel=sequence_parallel).items()},
        d.final_norm: norm_style(),
        d.head: ColwiseParallel(
            input_layouts=act,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def decoder_tp_sizes(args: DecoderArgs) -> dict[str, int]:
    """What the shared decoder's plan splits: whole query and kv heads, FFN hidden units, vocabulary rows."""
    return {
        "model.n_heads": args.n_heads,
        "model.n_kv_heads": args.n_kv_heads,
        "the model's FFN hidden size": args.ffn_hidden_dim,
        "the model's vocab size": args.vocab_size,
    }


def _is_tied(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))


def parallelize_decoder(
    model: nn.Module,
    mesh: ParallelMesh | None,
    dims: ParallelDims,
    options: ParallelizeOptions,
    tp_plan: Callable[..., TPPlan],
) -> nn.Module:
    """The module doc's order for any decoder family, with its plan (`tp_plan`, as ``FamilySpec.tp_plan``).

    Module names come from the model's ``decoder_layout``, so this serves any block shape; the plan is the family's.
    """
    options.validate(dims)
    decoder = decoder_layout(model)
    if mesh is None and dims.world_size > 1:
        raise ParallelismError(f"a world of {dims.world_size} processes needs a device mesh (build_mesh)")
    if dims.tp_enabled:
        plan = tp_plan(sequence_parallel=dims.sequence_parallel_enabled, loss_parallel=dims.loss_parallel_enabled)
        if dims.ep_enabled:
            plan = without_routed_experts(plan)
        plan = float8_tp_plan(resolve_plan(plan, model), model, mesh["tp"])
        apply_tp(model, mesh["tp"], lora_tp_plan(plan, model))
        if _is_tied(model):
            # Embedding rows and head columns are both Shard(0) of the same [vocab, dim] weight; the plan
            # distributed them separately, so make them one parameter again.
            decoder.tie_head(model)
        if options.async_tp:
            enable_async_tp(mesh["tp"])
    if dims.cp_enabled:
        # Before AC and compile, so that both see the attention that gathers keys and values over cp.
        apply_cp(model, mesh["cp"], options.cp_load_balancer, options.cp_rotate_method, options.cp_attention_path)
    elif options.flex_attention:
        # Before AC and compile too: the checkpointed, compiled blocks then build and use the block masks.
        use_flex_document_attention(model)
    if dims.ep_enabled:
        # Before AC and compile too: recomputation and compiled blocks then include the token exchange.
        apply_ep(model, mesh["ep"])
    if mesh is not None:
        reduce_expert_loads_over(model, mesh["dp_cp"])
    apply_ac(decoder.blocks_of(model), options.ac_mode, options.selective_ac_option)
    if options.ac_mode == "memory_budget":
        set_memory_budget(options.memory_budget)
    if options.compile_model:
        if options.compile_trace_dir:
            start_compile_trace(options.compile_trace_dir)
        apply_compile(
            model,
            options.compile_granularity,
            backend=options.compile_backend,
            mode=options.compile_mode,
            fullgraph=options.compile_fullgraph,
            dynamic=options.compile_dynamic,
        )
    param_dtype = parse_dtype(options.param_dtype, "training.mixed_precision_param")
    reduce_dtype = parse_dtype(options.reduce_dtype, "training.mixed_precision_reduce")
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            fsdp_mesh(mesh, dims),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=options.reshard_after_forward,
            cpu_offload=options.cpu_offload,
            experts_mesh=mesh["experts_fsdp"] if dims.ep_enabled else None,
        )
        return model
    # Without FSDP's policy, the forward computes in the run's dtype under autocast (mixed_precision.py).
    autocast_forward(model, options.device_type, param_dtype)
    if dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"])
        reduce_ddp_gradients_in(model, mesh["dp_replicate"], reduce_dtype)
    return model
