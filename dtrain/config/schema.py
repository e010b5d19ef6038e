"""The typed configuration of a dtrain run: one dataclass per TOML section (the sections of opt-in features, from
quantized linears to fault tolerance, are in schema_opt_in.py; those of compiling and watching a run in
schema_observe.py; [training.chat] in schema_chat.py).

Section and field names follow torchtitan v0.2.2 wherever the concept is the same, so that its TOML files mostly
just work here. Every field carries a one-line doc (shown by ``--help``) and, where the set of valid values is
closed, its choices (checked before anything runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dtrain.config.model_families import DEFAULT_MODEL_FAMILY, MODEL_FAMILIES, SPLIT_EXAMPLE_STAGES
from dtrain.config.evaluation import Eval
from dtrain.config.options import opt
from dtrain.config.preference import Preference
from dtrain.config.schema_chat import Chat
from dtrain.config.schema_observe import Compile, Metrics, Profiling
from dtrain.config.schema_opt_in import FaultTolerance, LoRA, Quantize


def _split_example() -> str:
    """The example pipeline split as TOML and on the command line (for the help)."""
    stages = SPLIT_EXAMPLE_STAGES
    as_toml = "[" + ", ".join("[" + ", ".join(f'"{name}"' for name in stage) + "]" for stage in stages) + "]"
    return f"{as_toml}; on the command line '" + ",".join(" ".join(stage) for stage in stages) + "'"


_SPLIT_EXAMPLE = _split_example()


@dataclass
class Job:
    config_file: str = opt("", "TOML file this run was configured from (set by --config / CONFIG_FILE).")
    dump_folder: str = opt("./outputs", "Run directory: resolved config, metrics, TensorBoard, traces, checkpoints.")
    description: str = opt("", "Free-text description of the experiment, written into the run directory.")
    print_config: bool = opt(False, "Print the resolved config as TOML and exit without training.")
    save_config_file: str | None = opt(
        None,
        "Also write the resolved config as JSON to this file inside job.dump_folder (torchtitan's key; config.toml "
        "is always written); unset = no JSON copy.",
    )


@dataclass
class Model:
    name: str = opt(DEFAULT_MODEL_FAMILY, "Model family.", choices=MODEL_FAMILIES)
    flavor: str = opt(
        "debugmodel",
        "Size preset of the family (each family's are listed in docs/models.md and in the error for an unknown one); "
        "empty = none, [model.args] gives every field (what a run started from a Hugging Face config.json records).",
    )
    tokenizer: str = opt(
        "auto",
        "Tokenizer kind; auto = byte-level when hf_assets_path is empty, else tokenizer.json or tokenizer.model there.",
        choices=("auto", "byte", "hf", "tiktoken"),
    )
    hf_assets_path: str = opt("", "Folder (or file) holding tokenizer.json or tokenizer.model; empty = built-in bytes.")
    vocab_size_from_tokenizer: bool = opt(
        False,
        "Size the vocabulary from the tokenizer, rounded up to vocab_size_multiple_of (Megatron's padded vocabulary), "
        "instead of the flavor's vocab_size (torchtitan's rule).",
    )
    vocab_size_multiple_of: int = opt(
        64, "With vocab_size_from_tokenizer: round the tokenizer's vocabulary up to this multiple (keeps TP splits even).",
        minimum=1,
    )
    tie_word_embeddings: bool | None = opt(
        None, "Share one weight between the token embedding and the output head; unset = the flavor's choice."
    )
    args: dict[str, Any] = opt(
        {},
        "Overrides of the flavor's shape, checked against the family's args: [model.args] n_layers = 2, or "
        "--model.args.n_layers 2 (none unsets an optional field).",
    )
    converters: list[str] = opt(
        [],
        "Model converters applied before parallelizing: float8 (torchao float8 training, configured in "
        "[quantize.linear.float8]; quantize.linear.float8 is the same) or mx (MXFP8 training, configured in "
        "[quantize.linear.mx]; quantize.linear.mx is the same).",
    )


@dataclass
class Optimizer:
    name: str = opt(
        "AdamW",
        "Optimizer: torch's AdamW or Adam, or torchao's with moments stored in 8 bits, 4 bits or float8 (AdamW8bit, "
        "AdamW4bit, AdamWFp8 and the Adam ones; only tensors of at least 4096 elements are quantized).",
        choices=("AdamW", "Adam", "AdamW8bit", "AdamW4bit", "AdamWFp8", "Adam8bit", "Adam4bit", "AdamFp8"),
    )
    lr: float = opt(8e-4, "Peak learning rate.", minimum=0.0)
    beta1: float = opt(0.9, "Adam beta1.", minimum=0.0)
    beta2: float = opt(0.95, "Adam beta2.", minimum=0.0)
    eps: float = opt(1e-8, "Adam epsilon.", minimum=0.0)
    weight_decay: float = opt(
        0.1, "Weight decay, on every parameter as in torchtitan (decoupled for AdamW, L2 for Adam).", minimum=0.0
    )
    no_decay_on_vectors: bool = opt(
        False, "Exempt norms, biases and other 1-D weights from weight decay (Megatron's practice, not torchtitan's)."
    )
    implementation: str = opt(
        "auto",
        "Optimizer kernel: fused or foreach where the device supports it (auto picks), or the plain for-loop; "
        "torch's AdamW and Adam only (torchao's compile their own step).",
        choices=("auto", "fused", "foreach", "for-loop"),
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(
        200,
        "Linear warmup steps: step k (from 1) runs at k/warmup_steps of optimizer.lr; cut to the schedule's length.",
        minimum=0,
    )
    decay_ratio: float | None = opt(
        None,
        "Fraction of steps spent decaying at the end (WSD); unset = decay right after warmup.",
        minimum=0.0,
    )
    decay_type: str = opt("linear", "Shape of the decay.", choices=("linear", "sqrt", "cosine"))
    min_lr_factor: float = opt(
        0.0, "Learning rate the decay ends at, as a fraction of optimizer.lr (reached one step after the schedule).",
        minimum=0.0,
    )
    total_steps: int | None = opt(
        None,
        "Steps the schedule spans (warmup, stable, decay); unset = training.steps. Longer than training.steps stops "
        "partway along the curve (a short debug run with the real schedule's shape); shorter holds the final rate.",
        minimum=1,
    )


@dataclass
class DataLoader:
    num_workers: int = opt(
        0,
        "Background worker processes that read, tokenize and pack batches ahead of the step; 0 = a background "
        "thread does it (the step never waits on tokenization either way).",
        minimum=0,
    )
    persistent_workers: bool = opt(False, "Keep the worker processes alive between passes over the data.")
    pin_memory: bool = opt(False, "Copy batches into pinned host memory (faster host-to-GPU copies; CUDA only).")
    prefetch_factor: int | None = opt(
        None, "Batches each worker (or the thread) keeps ready ahead of the step; unset = 2.", minimum=1
    )


DATASET_KINDS = (
    "builtin", "synthetic", "files", "hf", "c4", "c4_test", "c4_validation", "tokens", "chat", "preference",
    "mixture",
)


@dataclass
class Training:
    dataset: str = opt(
        "builtin",
        "Data source: builtin (stdlib sources, no download), synthetic, files (text/JSONL/Parquet at dataset_path), "
        "hf (Hugging Face datasets at dataset_path), c4 (a local copy made by scripts/download_hf_assets.py; "
        "c4_test: its first 2000 training documents, c4_validation: its validation split), tokens (a folder of "
        "token shards written by scripts/tokenize_dataset.py), chat (conversations for fine-tuning at dataset_path, "
        "see [training.chat]; empty path: bundled arithmetic chats), preference (chosen/rejected pairs, see "
        "[training.preference]; empty path: bundled pairs) or mixture (the sources of dataset_mixture).",
        choices=DATASET_KINDS,
    )
    dataset_path: str = opt("", "File, folder or HF dataset path/name for files, hf, c4 and tokens datasets.")
    dataset_text_field: str = opt("text", "Field holding the document text in JSONL, Parquet and HF datasets.")
    dataset_shuffle: bool = opt(
        True, "tokens datasets: take the samples in a seeded random order, a new one each epoch (false: in order)."
    )
    dataset_mixture: list[list[str]] = opt(
        [],
        "With dataset = mixture: the sources and their weights, each [kind, weight] or [kind, path, weight], e.g. "
        '[["tokens", "/data/web", "0.7"], ["files", "/data/code", "0.3"]]; samples interleave in proportion.',
    )
    local_batch_size: int = opt(8, "Sequences per microbatch on each data-parallel rank.", minimum=1)
    global_batch_size: int = opt(
        -1, "Sequences per optimizer step over all ranks; -1 = local_batch_size × data-parallel size.", minimum=-1
    )
    seq_len: int = opt(2048, "Tokens per sequence.", minimum=2)
    attention_mask: str = opt(
        "causal",
        "causal: every token attends to all earlier tokens of its packed sequence; block_causal (document masking): "
        "only to earlier tokens of its own document (a new document starts at each BOS).",
        choices=("causal", "block_causal"),
    )
    attention_mask_backend: str = opt(
        "auto",
        "How block_causal masks documents: dense (a [seq, seq] mask to SDPA, memory in seq²), flex (FlexAttention "
        "block masks, CUDA only: no CPU backward) or auto (flex on CUDA, dense elsewhere).",
        choices=("auto", "dense", "flex"),
    )
    max_norm: float = opt(
        1.0, "Clip the 2-norm of all gradients together to this value (torchtitan's clipping); 0 disables clipping.",
        minimum=0.0,
    )
    steps: int = opt(10000, "Optimizer steps to train.", minimum=1)
    mixed_precision_param: str = opt(
        "bfloat16",
        "Compute dtype of every layout (FSDP casts parameters to it; other layouts run the forward under autocast); "
        "parameters, gradients and optimizer state stay float32.",
        choices=("bfloat16", "float32", "float16"),
    )
    mixed_precision_reduce: str = opt(
        "float32", "Dtype of data-parallel gradient reductions (FSDP, HSDP, DDP).", choices=("float32", "bfloat16")
    )
    enable_cpu_offload: bool = opt(False, "Keep FSDP2-sharded parameters, gradients and optimizer state on CPU.")
    gc_freq: int = opt(50, "Run Python garbage collection every this many steps (automatic GC is disabled).", minimum=1)
    skip_nonfinite_steps: int = opt(
        0,
        "Steps with a non-finite loss or gradient norm to skip (no update) before the run stops; 0 stops at the "
        "first. Above 0 the step reads the loss on the host every step.",
        minimum=0,
    )
    skip_memory_check: bool = opt(
        False,
        "Start even when the pre-flight estimate of per-rank memory (params, grads, optimizer, activations, batches) "
        "exceeds the device's or the host's memory; the estimate is then logged as a warning.",
    )
    dataloader: DataLoader = field(default_factory=DataLoader)
    chat: Chat = field(default_factory=Chat)
    preference: Preference = field(default_factory=Preference)


@dataclass
class Validation:
    enable: bool = opt(False, "Evaluate the loss on held-out data every validation.freq steps.")
    dataset: str = opt(
        "builtin",
        "Held-out data, the kinds of training.dataset plus c4_validation: builtin evaluates on a held-out part of "
        "the built-in corpus that training never reads.",
    )
    dataset_path: str = opt("", "File, folder or HF dataset path/name of the validation data (as training's).")
    local_batch_size: int = opt(8, "Sequences per validation batch on each data-parallel rank.", minimum=1)
    seq_len: int = opt(2048, "Tokens per validation sequence.", minimum=2)
    freq: int = opt(10, "Evaluate every this many training steps.", minimum=1)
    steps: int = opt(
        -1, "Batches per evaluation; -1 = the whole validation set (sources that never end are refused).", minimum=-1
    )
    dataloader: DataLoader = field(default_factory=DataLoader)


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "Replicas of the model (DDP, or HSDP's outer dimension).", minimum=1)
    data_parallel_shard_degree: int = opt(-1, "FSDP2 shard degree; -1 = whatever the other degrees leave.", minimum=-1)
    fsdp_reshard_after_forward: str = opt(
        "default",
        "Free gathered parameters after forward: default (yes, except the last block), always or never.",
        choices=("default", "always", "never"),
    )
    tensor_parallel_degree: int = opt(1, "Tensor (+ sequence) parallel degree.", minimum=1)
    disable_loss_parallel: bool = opt(False, "Gather logits before the loss instead of a vocab-parallel loss under TP.")
    disable_sequence_parallel: bool = opt(
        False, "Under TP, keep activations between blocks replicated instead of split along the sequence (more memory)."
    )
    enable_async_tensor_parallel: bool = opt(False, "Overlap TP communication with matmuls (CUDA + compile only).")
    pipeline_parallel_degree: int = opt(1, "Pipeline stages over ranks.", minimum=1)
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "Pipeline schedule, any case: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
        "ZBVZeroBubble or DualPipeV.",
    )
    pipeline_parallel_microbatch_size: int = opt(1, "Sequences per pipeline microbatch.", minimum=1)
    pipeline_parallel_layers_per_stage: int | None = opt(
        None,
        "Layers per pipeline stage (embedding and head count as one each); sets the number of stages. Unset = one "
        "stage per rank, two for multi-stage schedules.",
        minimum=1,
    )
    module_fqns_per_model_part: list[list[str]] = opt(
        [],
        "Explicit pipeline split, the module names of each stage as the start-up log lists them, e.g. "
        f"{_SPLIT_EXAMPLE}. Empty = split evenly.",
    )
    context_parallel_degree: int = opt(
        1, "Context parallel degree: every sequence is split over this many ranks (long contexts).", minimum=1
    )
    context_parallel_load_balancer: str = opt(
        "headtail",
        "How context parallel cuts a sequence: headtail (rank i holds chunks i and 2·cp−1−i of 2·cp, even causal "
        "attention work) or none (rank i holds the i-th 1/cp).",
        choices=("headtail", "none"),
    )
    context_parallel_rotate_method: str = opt(
        "allgather",
        "How keys and values reach every context-parallel rank under torch's ring attention (CUDA, causal "
        "mask): allgather or alltoall; elsewhere dtrain all-gathers them, and alltoall is refused.",
        choices=("allgather", "alltoall"),
    )
    expert_parallel_degree: int = opt(
        1,
        "Expert parallel degree (MoE models): each MoE layer's experts are split over this many of the "
        "data_parallel_shard_degree × context_parallel_degree ranks, which it must divide.",
        minimum=1,
    )
    expert_tensor_parallel_degree: int = opt(
        1,
        "Tensor-parallel split of each routed expert (MoE models); only 1 is built: under TP every rank keeps whole "
        "experts (or its expert-parallel share) and routes the whole sequence.",
        minimum=1,
    )


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints and resume from them.")
    folder: str = opt("checkpoint", "Checkpoint folder inside job.dump_folder.")
    interval: int = opt(500, "Save every this many steps.", minimum=1)
    keep_latest_k: int = opt(10, "Keep this many newest checkpoints; 0 keeps all.", minimum=0)
    load_step: int = opt(-1, "Step to resume from; -1 = the latest complete checkpoint.", minimum=-1)
    async_mode: str = opt(
        "disabled", "Checkpoint saving mode.", choices=("disabled", "async", "async_with_pinned_mem")
    )
    initial_load_path: str = opt("", "Checkpoint to start from when the run directory has none.")
    initial_load_model_only: bool = opt(True, "Load only model weights from initial_load_path.")
    initial_load_in_hf: bool = opt(False, "initial_load_path holds Hugging Face safetensors.")
    initial_load_partial: bool = opt(
        False,
        "Let a DCP initial_load_path load only the weights it shares with this model: its weights the model does "
        "not take, and the model's weights it lacks (they keep their init), are listed in the log instead of "
        "refused. Weights only (initial_load_model_only).",
    )
    initial_load_writer: str = opt(
        "auto",
        "Who wrote a DCP initial_load_path that has no dtrain commit record, which decides how its weights are laid "
        "out: auto (tell by the names; refuse where they cannot, e.g. torchtitan v0.2 Qwen3), dtrain or torchtitan.",
        choices=("auto", "dtrain", "torchtitan"),
    )
    last_save_model_only: bool = opt(
        False,
        "The final save holds model weights only, in export_dtype (an export). Off by default, unlike torchtitan, "
        "so that rerunning a finished run with more steps continues from its last step.",
    )
    last_save_in_hf: bool = opt(
        False,
        "The final save is Hugging Face safetensors (with config.json) instead of DCP; needs last_save_model_only.",
    )
    export_dtype: str = opt(
        "float32", "dtype of a model-only save.", choices=("float32", "bfloat16", "float16")
    )
    enable_first_step_checkpoint: bool = opt(
        False, "Also save right after the first step (a quick check that saving works before a long run)."
    )
    load_only: bool = opt(
        False, "Load checkpoints (resume or initial_load_path) but never save one."
    )
    exclude_from_loading: list[str] = opt([], "State parts not to load on resume (e.g. optimizer, dataloader).")
    require_checkpoint: bool = opt(
        False, "Fail at start-up instead of starting from scratch when neither the run directory nor "
        "initial_load_path holds a checkpoint."
    )
    fallback_to_previous: bool = opt(
        False, "When the newest checkpoint is damaged or unreadable, resume from the newest intact one before it "
        "instead of failing."
    )
    create_seed_checkpoint: bool = opt(
        False, "Initialise the model in one process, save its weights as step-0 in the run directory and exit; "
        "later runs on any layout start from those weights."
    )


@dataclass
class ActivationCheckpoint:
    mode: str = opt(
        "none",
        "Recompute activations in backward: none, full, selective, or memory_budget (torch.compile's partitioner "
        "keeps what fits activation_checkpoint.memory_budget; needs compile).",
        choices=("none", "full", "selective", "memory_budget"),
    )
    selective_ac_option: str = opt(
        "2", "Selective AC: an integer N checkpoints every Nth block; op saves a list of ops and recomputes the rest."
    )
    memory_budget: float = opt(
        0.5,
        "For mode memory_budget: 0.0 keeps what full AC keeps, 1.0 what compile keeps without AC; between, the "
        "partitioner recomputes the cheapest ops to fit.",
    )


@dataclass
class Debug:
    seed: int = opt(0, "Seed from which every random stream (init, data, dropout) is derived.", minimum=0)
    deterministic: bool = opt(False, "Use deterministic algorithms only (slower; bit-identical runs on GPU too).")
    deterministic_warn_only: bool = opt(
        False, "With debug.deterministic: an op without a deterministic implementation warns instead of failing."
    )


@dataclass
class Comm:
    init_timeout_seconds: int = opt(
        300, "Seconds collectives may wait until the first step is done (start-up, checkpoint load, compilation).",
        minimum=1,
    )
    train_timeout_seconds: int = opt(
        100, "Seconds any collective may wait after the first step: a hung or dead rank ends the run.", minimum=1
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)
    comm: Comm = field(default_factory=Comm)
    quantize: Quantize = field(default_factory=Quantize)
    lora: LoRA = field(default_factory=LoRA)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    eval: Eval = field(default_factory=Eval)
