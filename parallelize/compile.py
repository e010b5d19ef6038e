"""torch.compile of the model (per transformer block, or the whole model part) and a structured compile trace.

Per block (the default, torchtitan's choice): each block is compiled in place (``nn.Module.compile``), so parameter
names do not change. The blocks are identical modules, so dynamo compiles the first one and reuses its graph for
the rest: compile time does not grow with depth. ``model_whole`` compiles the whole model part (a pipeline stage
under PP) in one call instead, for comparison: one larger graph, longer compiles, the embedding and head inside.
Either way compile comes after activation checkpointing and before data parallel (the module doc of decoder_plan.py).

What torch.compile did (times, graphs, breaks, recompiles, caches) is ``dtrain.observe.compile_report``'s.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

from torch import nn

from dtrain.models.decoder import decoder_layout
from dtrain.models.moe import MoE
from dtrain.parallelize.errors import ParallelismError

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The modes that capture CUDA graphs: on another device they would quietly do less than they say.
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
DYNAMIC_SHAPES = {"false": False, "true": True, "auto": None}
GRANULARITIES = ("per_block", "model_whole")

_trace_handler: logging.Handler | None = None


def check_compile_options(
    mode: str, dynamic: str, granularity: str, backend: str, device_type: str, *, fullgraph: bool, data_parallel: bool
) -> None:
    """Refuse compile options that cannot do what they say here, in one line naming the key."""
    if mode not in COMPILE_MODES:
        raise ParallelismError(f"compile.mode={mode!r} is invalid (valid: {', '.join(COMPILE_MODES)})")
    if dynamic not in DYNAMIC_SHAPES:
        raise ParallelismError(f"compile.dynamic={dynamic!r} is invalid (valid: {', '.join(DYNAMIC_SHAPES)})")
    if granularity not in GRANULARITIES:
        raise ParallelismError(f"compile.granularity={granularity!r} is invalid (valid: {', '.join(GRANULARITIES)})")
    if mode != "default" and backend != "inductor":
        raise ParallelismError(
            f"compile.mode={mode!r} is an inductor option that compile.backend={backend!r} ignores "
            "(set compile.backend = inductor, or compile.mode = default)"
        )
    if granularity == "model_whole" and fullgraph and data_parallel:
        raise ParallelismError(
            "compile.granularity='model_whole' with compile.fullgraph = true cannot run under FSDP or DDP: dynamo "
            "does not trace their hooks inside the model (set compile.fullgraph = false to break the graph there, "
            "or compile.granularity = per_block)"
        )
    if mode in CUDA_GRAPH_MODES and device_type != "cuda":
        raise ParallelismError(
            f"compile.mode={mode!r} captures CUDA graphs and needs a CUDA device, not {device_type} "
            "(use max-autotune-no-cudagraphs or default)"
        )


def compile_kwargs(backend: str, mode: str = "default", fullgraph: bool = True, dynamic: str = "auto") -> dict:
    """The keyword arguments of ``torch.compile`` for these config values (compile.dynamic auto is torch's None:
    static first, then dynamic after a shape change)."""
    return dict(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=DYNAMIC_SHAPES[dynamic])


def apply_compile(
    model: nn.Module,
    granularity: str = "per_block",
    *,
    backend: str = "inductor",
    mode: str = "default",
    fullgraph: bool = True,
    dynamic: str = "auto",
) -> None:
    """Compile `model`'s blocks (its ``decoder_layout``'s), or with ``model_whole`` the model itself, in place.

    ``fullgraph=True`` (the default) makes a graph break inside a compiled unit an error, not a silent slowdown.
    Units with an MoE layer always compile without it: sizing the expert-parallel all-to-alls and the per-expert
    loop read token counts on the host, and the experts are an FSDP unit of their own inside the block, whose hooks
    dynamo does not trace; those units compile into the graphs between such breaks.
    """
    units = [model] if granularity == "model_whole" else list(decoder_layout(model).blocks_of(model).values())
    for unit in units:
        has_moe = any(isinstance(module, MoE) for module in unit.modules())
        unit.compile(**compile_kwargs(backend, mode, fullgraph and not has_moe, dynamic))


def start_compile_trace(trace_dir: str) -> None:
    """Write torch's structured compile log (what ``TORCH_TRACE=<dir>`` writes) into ``trace_dir``.

    One ``dedicated_log_torch_trace_rank_<r>_*.log`` file per rank; ``tlparse <file>`` renders it as HTML with
    every graph, guard, recompile and graph break. Setting the ``TORCH_TRACE`` variable would have to happen
    before torch is imported; this attaches the same handler at run time instead.
    """
    global _trace_handler
    from torch._logging._internal import LazyTraceHandler, TorchLogsFormatter, trace_log

    stop_compile_trace()
    handler = LazyTraceHandler(trace_dir)
    handler.setFormatter(TorchLogsFormatter(trace=True))
    trace_log.setLevel(logging.DEBUG)
    trace_log.addHandler(handler)
    _trace_handler = handler


def stop_compile_trace() -> None:
    """Detach (and flush) the handler that ``start_compile_trace`` attached, if any."""
    global _trace_handler
    from torch._logging._internal import trace_log

    if _trace_handler is not None:
        trace_log.removeHandler(_trace_handler)
        _trace_handler.close()
        _trace_handler = None


@contextlib.contextmanager
def compile_debug_output(folder: str) -> Iterator[None]:
    """A context in which inductor writes the code it generates (what ``TORCH_COMPILE_DEBUG=1`` writes: FX graphs,
    IR before and after fusion, ``output_code.py``) into ``folder/torchinductor``, one subfolder per graph.

    Caches are off inside it: a cache hit skips code generation and would write nothing. Inductor's warning line
    per graph ("debug trace: <folder>") and dynamo's warning that caches are off are kept out of the log: the
    trainer names the folder once.
    """
    from torch._inductor import config as inductor_config

    debug_log = logging.getLogger("torch._inductor.debug")
    level = debug_log.level
    debug_log.setLevel(logging.ERROR)
    try:
        with (
            inductor_config.patch({"trace.enabled": True, "trace.debug_dir": folder, "force_disable_caches": True}),
            warnings.catch_warnings(),
        ):
            warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
            yield
    finally:
        debug_log.setLevel(level)
