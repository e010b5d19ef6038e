"""The config sections of opt-in features: low-precision linears ([quantize]), LoRA and QLoRA ([lora]) and fault
tolerance across replica groups ([fault_tolerance]). JobConfig (schema.py) holds them like every other section."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.config.options import opt


@dataclass
class QuantizeLinearFloat8:
    recipe_name: str = opt(
        "tensorwise",
        "float8 scaling: tensorwise (one scale per tensor), rowwise (per row), or rowwise_with_gw_hp (rowwise, the "
        "weight gradient in high precision).",
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    )
    enable_fsdp_float8_all_gather: bool = opt(
        False, "FSDP2 all-gathers float8 weights (half of bf16's traffic); tensorwise only, ignored without FSDP."
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "Compute all float8 weight scales in one all-reduce after each optimizer step (needs the all-gather)."
    )
    filter_fqns: list[str] = opt(
        ["output"],
        "Linears whose module name contains any of these stay in high precision; linears with a dimension not "
        "divisible by 16 always do.",
    )
    emulate: bool = opt(
        False,
        "Emulate float8 matmuls in high precision; chosen automatically where the device has no float8 matmuls "
        "(CPU, CUDA capability < 8.9).",
    )


@dataclass
class QuantizeLinearMX:
    recipe_name: str = opt(
        "mxfp8_rceil",
        "MXFP8 recipe (torchao's): mxfp8_rceil (MX matmuls, needs a Blackwell-class GPU), mxfp8_rceil_wgrad_with_hp "
        "(the weight gradient in high precision), or mxfp8_emulated_rceil (the same casts, matmuls emulated in high "
        "precision: any device, slowly).",
        choices=("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil"),
    )
    filter_fqns: list[str] = opt(
        ["output"],
        "Linears whose module name contains any of these stay in high precision; linears with a dimension not "
        "divisible by 32 (the MX block) always do.",
    )


@dataclass
class QuantizeLinear:
    float8: QuantizeLinearFloat8 = field(default_factory=QuantizeLinearFloat8)
    mx: QuantizeLinearMX = field(default_factory=QuantizeLinearMX)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


@dataclass
class LoRA:
    enable: bool = opt(False, "Fine-tune low-rank adapters (LoRA) on the targeted linears; base weights are frozen.")
    rank: int = opt(8, "Adapter rank r (PEFT's r).", minimum=1)
    alpha: float = opt(
        16.0, "Adapter scale numerator: updates are scaled by alpha / rank (PEFT's lora_alpha).", minimum=0.0
    )
    dropout: float = opt(0.0, "Dropout on the adapters' input (PEFT's lora_dropout), in [0, 1).", minimum=0.0)
    target_modules: list[str] = opt(
        ["wq", "wk", "wv", "wo"],
        "Linears to adapt: patterns matched against the end of module names, one dotted atom at a time with * "
        "globs (wq, attention.*, feed_forward.w1, layers.0.attention.wq), or all-linear (all but the output head).",
    )
    use_rslora: bool = opt(False, "rsLoRA: scale updates by alpha / sqrt(rank) instead of alpha / rank.")
    quantize_base: bool = opt(
        False,
        "QLoRA: store the adapted linears' frozen base weights as torchao NF4 (4-bit, ~0.52 bytes per value), "
        "quantized after checkpoint.initial_load_path loads them; one process or FSDP2.",
    )
    initial_adapter_path: str = opt(
        "",
        "PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start the adapters from, on the "
        "base of checkpoint.initial_load_path; its r, lora_alpha, use_rslora and targets must match [lora].",
    )


@dataclass
class FaultTolerance:
    enable: bool = opt(
        False,
        "Fault-tolerant data parallel across replica groups with torchft: each launch is one group (any layout "
        "inside it); a lost group is dropped and a restarted one takes the live state from a peer.",
    )
    process_group: str = opt(
        "gloo", "Backend of the reconfigurable process group between the groups (nccl needs CUDA).",
        choices=("gloo", "nccl"),
    )
    process_group_timeout_ms: int = opt(
        10000, "Milliseconds a collective between the groups may take before the peer is taken for lost.", minimum=1
    )
    replica_id: int = opt(0, "This group's id, in [0, group_size): its share of the data and its name.", minimum=0)
    group_size: int = opt(
        0, "The number of replica groups the job is made for (each reads 1/group_size of the data).", minimum=0
    )
    min_replica_size: int = opt(
        1, "Fewest groups a step (or a sync) needs to commit; with fewer the step is retried.", minimum=1
    )
    join_timeout_seconds: float = opt(
        60.0,
        "A group's first step waits this long for all group_size groups (its attempts discarded meanwhile), then "
        "trains with those present; a group joining a running job recovers live instead.",
        minimum=0.0,
    )
    quorum_timeout_seconds: float = opt(
        60.0,
        "A quorum after the group's first fails after this long (the lighthouse lost): the group saves its last "
        "step and ends (the first quorum waits comm.init_timeout_seconds).",
        minimum=1.0,
    )
    semi_sync_method: str = opt(
        "",
        "Empty: gradients are averaged over the groups every step. local_sgd: each group steps alone and the "
        "weights are averaged every sync_steps; diloco: the same with an outer optimizer on the averaged change.",
        choices=("", "local_sgd", "diloco"),
    )
    sync_steps: int = opt(5, "local_sgd/diloco: optimizer steps between two synchronizations.", minimum=1)
    outer_lr: float = opt(0.7, "diloco: learning rate of the outer SGD (Nesterov momentum).", minimum=0.0)
    outer_momentum: float = opt(0.9, "diloco: momentum of the outer SGD.", minimum=0.0)
    lighthouse: str = opt(
        "",
        "Address of torchft's lighthouse (e.g. http://host:29510); empty: the TORCHFT_LIGHTHOUSE variable.",
    )
