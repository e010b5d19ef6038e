"""The config sections of how a run is compiled and watched: [compile], [metrics] and [profiling] (read by
dtrain/observe/ and dtrain/metrics/). JobConfig (schema.py) holds them like every other section."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config.options import opt


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile the components below (the model as compile.granularity says).")
    components: list[str] = opt(["model", "loss"], "What to compile: model and/or loss.")
    backend: str = opt("inductor", "torch.compile backend.")
    mode: str = opt(
        "default",
        "torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune, or max-autotune-no-cudagraphs; "
        "the CUDA-graph modes need CUDA.",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )
    fullgraph: bool = opt(
        True, "Refuse graph breaks inside a compiled unit (false: break and run the rest eagerly); units with MoE "
        "layers always allow them.",
    )
    dynamic: str = opt(
        "auto",
        "Dynamic shapes: false (specialize on every shape), true (symbolic shapes from the start), or auto "
        "(torch's default: specialize, then recompile dynamic on a shape change).",
        choices=("false", "true", "auto"),
    )
    granularity: str = opt(
        "per_block",
        "What one torch.compile call covers: per_block (each transformer block, as torchtitan does: small graphs, "
        "fast compiles) or model_whole (the whole model part in one graph, for comparison).",
        choices=("per_block", "model_whole"),
    )
    trace_folder: str = opt(
        "", "Folder inside job.dump_folder for torch's structured compile trace (TORCH_TRACE; open with tlparse); "
        "empty = off."
    )
    cache: bool = opt(
        False,
        "With compile.enable: save torch's portable compile cache (torch.compiler.save_cache_artifacts) after the "
        "first step and load it before the first step of a later run of the same model and layout: a resumed run "
        "skips AOT autograd and inductor (on CPU the C++ kernels are still built, unless this machine's inductor "
        "cache has them).",
    )
    cache_dir: str = opt(
        "",
        "Where compile.cache keeps its files (one subfolder per model/layout key); relative to job.dump_folder "
        "unless absolute; empty = <dump_folder>/compile_cache. Share it between runs to reuse their compiles; only "
        "a folder you trust (loading runs the code in it).",
    )
    debug_dir: str = opt(
        "",
        "With compile.enable: folder inside job.dump_folder for inductor's generated code of what the first step "
        "compiles (the TORCH_COMPILE_DEBUG output: FX graphs, IR before and after fusion, output_code.py), one "
        "folder per rank; the first step then compiles without caches; empty = off.",
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log one metrics line every this many steps.", minimum=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard events under <dump_folder>/<save_tb_folder>.")
    save_tb_folder: str = opt("tb", "TensorBoard folder inside job.dump_folder.")
    save_for_all_ranks: bool = opt(False, "Every rank writes its own metrics files (rank 0 only by default).")
    enable_wandb: bool = opt(
        False,
        "Log metrics to Weights & Biases (needs the wandb package; WANDB_PROJECT, WANDB_MODE=offline etc. are "
        "respected; runs are stored under job.dump_folder).",
    )
    disable_color_printing: bool = opt(False, "Never colour the console metrics line (it is coloured only on a TTY).")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record a torch.profiler window every profile_freq steps.")
    save_traces_folder: str = opt("profile_traces", "Trace folder inside job.dump_folder.")
    profile_freq: int = opt(10, "Steps between profiler windows.", minimum=1)
    profiler_warmup: int = opt(3, "Warmup steps inside each profiler window.", minimum=0)
    profiler_active: int = opt(1, "Recorded steps inside each profiler window.", minimum=1)
    record_shapes: bool = opt(False, "Profiler: record the input shapes of every operator (its top-k table shows them).")
    with_stack: bool = opt(False, "Profiler: record the Python stack of every operator (larger traces).")
    profile_memory: bool = opt(
        False, "Profiler: track tensor allocations; on CUDA also export the memory timeline beside the trace."
    )
    top_ops: int = opt(
        15, "Operators in the table of each profiler window (by self time), logged and written beside its trace; "
        "0 = none.", minimum=0,
    )
    enable_memory_snapshot: bool = opt(False, "Dump a CUDA allocator memory snapshot (CUDA only).")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Memory snapshot folder inside job.dump_folder.")
