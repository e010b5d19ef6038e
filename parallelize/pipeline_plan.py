"""Which pipeline stage holds which modules, and which rank runs which stage: checked before any process group.

A decoder is cut into stages along its forward order: embedding, blocks 0 .. N-1, final norm, head (the names
come from the model's ``DecoderLayout``, e.g. ``<embedding>, <blocks>.0 .. <blocks>.N-1, <final norm>, <head>``).
``plan_pipeline`` turns the ``[parallelism]`` pipeline keys into a ``PipelinePlan`` (stage -> module names,
stage -> rank, microbatches) or raises a one-line ``ParallelismError`` naming the keys to change. It is plain
arithmetic, so an impossible split fails in a second, before any process exists.

Default split: the embedding and the head (final norm + head) each count as one layer, and these
N + 2 units are spread evenly over the stages, earlier stages taking one more unit when they do not divide.
Stages per rank: one for single-stage schedules (GPipe, 1F1B), two for multi-stage schedules unless
``pipeline_parallel_layers_per_stage`` or an explicit module list asks for more. Stage ``s`` runs on rank
``s mod pp`` (loop) for the interleaved schedules; the V schedules (ZBVZeroBubble, DualPipeV) give rank ``r``
stages ``r`` and ``2 pp - 1 - r``, so the first and the last stage share rank 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from dtrain.models.decoder import DecoderLayout
from dtrain.parallelize.errors import ParallelismError

# torch.distributed.pipelining's schedules under their canonical names (matched case-insensitively).
PIPELINE_SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
)
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split backward into input-gradient and weight-gradient passes run at different times.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

_KEY = {
    "pp": "parallelism.pipeline_parallel_degree",
    "schedule": "parallelism.pipeline_parallel_schedule",
    "microbatch": "parallelism.pipeline_parallel_microbatch_size",
    "layers_per_stage": "parallelism.pipeline_parallel_layers_per_stage",
    "modules": "parallelism.module_fqns_per_model_part",
    "local_batch": "training.local_batch_size",
    "tie": "model.tie_word_embeddings",
    "reshard": "parallelism.fsdp_reshard_after_forward",
    "replicate": "parallelism.data_parallel_replicate_degree",
    "shard": "parallelism.data_parallel_shard_degree",
}


def canonical_schedule_name(name: str) -> str:
    """The canonical spelling of a schedule name given in any case; a one-line error when it is none."""
    names = {s.lower(): s for s in PIPELINE_SCHEDULES}
    if name.lower() not in names:
        raise ParallelismError(f"{_KEY['schedule']}={name!r} is invalid (valid: {', '.join(PIPELINE_SCHEDULES)})")
    return names[name.lower()]


@dataclass(frozen=True)
class PipelinePlan:
    """A checked pipeline layout: the modules of every stage, the rank of every stage, and the microbatching."""

    schedule: str
    pp: int
    stage_modules: tuple[tuple[str, ...], ...]
    n_microbatches: int
    microbatch_size: int
    decoder: DecoderLayout

    @property
    def num_stages(self) -> int:
        return len(self.stage_modules)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    @property
    def style(self) -> str:
        """``loop`` (stage s on rank s mod pp) or ``v`` (rank r holds stages r and 2 pp - 1 - r)."""
        return "v" if self.schedule in V_SCHEDULES else "loop"

    @property
    def split_backward(self) -> bool:
        """The schedule computes weight gradients separately from (and later than) input gradients."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    def stage_indices(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank `pp_rank` runs, in increasing order."""
        if self.style == "v":
            return (pp_rank, self.num_stages - 1 - pp_rank)
        return tuple(range(pp_rank, self.num_stages, self.pp))

    def rank_of_stage(self, stage: int) -> int:
        return next(rank for rank in range(self.pp) if stage in self.stage_indices(rank))

    def describe(self) -> str:
        """Several lines for the log: the schedule, the microbatching, and every stage's rank and modules."""
        lines = [
            f"pipeline: {self.schedule} over {self.pp} ranks, {self.num_stages} stages ({self.stages_per_rank} per "
            f"rank, {self.style} placement), {self.n_microbatches} microbatches of {self.microbatch_size} sequences"
        ]
        for stage, modules in enumerate(self.stage_modules):
            lines.append(
                f"  stage {stage} on pp rank {self.rank_of_stage(stage)}: {compact_names(modules, self.decoder)}"
            )
        return "\n".join(lines)


def compact_names(modules: Sequence[str], decoder: DecoderLayout) -> str:
    """A run of consecutive blocks as one range (e.g. ``<embedding>, <blocks>.0-3, <final norm>``)."""
    parts: list[str] = []
    run: list[int] = []  # consecutive layer indices not yet written

    def flush() -> None:
        if run:
            parts.append(decoder.block(run[0]) if len(run) == 1 else f"{decoder.block(run[0])}-{run[-1]}")
            run.clear()

    for name in modules:
        index = decoder.block_index(name)
        if index is not None and run and index == run[-1] + 1:
            run.append(index)
            continue
        flush()
        if index is None:
            parts.append(name)
        else:
            run.append(index)
    flush()
    return ", ".join(parts)


def even_split(decoder: DecoderLayout, n_layers: int, num_stages: int) -> list[list[str]]:
    """Spread the N + 2 units (embedding, N blocks, head) over `num_stages`; earlier stages take the remainder."""
    units = decoder.pipeline_units(n_layers)
    base, extra = divmod(len(units), num_stages)
    stages, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        stages.append([name for unit in units[start : start + size] for name in unit])
        start += size
    return stages


def parse_stage_modules(spec: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """Per-stage module names from a list of lists, or from config strings with names separated by spaces."""
    return [item.split() if isinstance(item, str) else [str(name) for name in item] for item in spec]


def _check_stage_modules(stages: list[list[str]], decoder: DecoderLayout, n_layers: int) -> None:
    """Every module exactly once, in forward order, and no empty stage."""
    expected = decoder.module_names(n_layers)
    known = set(expected)
    valid = (
        f"list {decoder.embedding}, {decoder.block(0)} .. {decoder.block(n_layers - 1)}, {decoder.final_norm}, "
        f"{decoder.head} once each, in this order"
    )
    seen: set[str] = set()
    for stage, names in enumerate(stages):
        if not names:
            raise ParallelismError(f"{_KEY['modules']}: stage {stage} holds no module; every stage needs at least one")
        for name in names:
            if name not in known:
                raise ParallelismError(f"{_KEY['modules']}: unknown module {name!r} in stage {stage} ({valid})")
            if name in seen:
                raise ParallelismError(f"{_KEY['modules']}: module {name!r} appears in more than one place")
            seen.add(name)
    missing = [name for name in expected if name not in seen]
    if missing:
        raise ParallelismError(f"{_KEY['modules']}: no stage holds {compact_names(missing, decoder)} ({valid})")
    flat = [name for names in stages for name in names]
    if flat != expected:
        first = next(i for i, (got, want) in enumerate(zip(flat, expected)) if got != want)
        raise ParallelismError(
            f"{_KEY['modules']}: {flat[first]!r} comes where the forward runs {expected[first]!r} ({valid})"
        )


def _layers_per_stage_hint(units: int, pp: int, per_rank: Sequence[int]) -> str:
    """The layers_per_stage values that give `pp × k` stages for some k in `per_rank`, as a message hint."""
    counts = {pp * k for k in per_rank}
    values = [str(lps) for lps in range(1, units + 1) if math.ceil(units / lps) in counts]
    return f"{_KEY['layers_per_stage']} in {{{', '.join(values)}}} or unset" if values else f"{_KEY['layers_per_stage']} unset"


def _num_stages(schedule: str, pp: int, n_layers: int, layers_per_stage: int | None) -> tuple[int, str]:
    """The number of stages and the setting that decided it (for messages)."""
    units = n_layers + 2
    if layers_per_stage is None:
        per_rank = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
        return pp * per_rank, f"{_KEY['pp']}={pp} with {per_rank} stage(s) per rank"
    if layers_per_stage < 1:
        raise ParallelismError(f"{_KEY['layers_per_stage']}={layers_per_stage} is invalid (valid: a positive integer)")
    num_stages = math.ceil(units / layers_per_stage)
    if num_stages % pp:
        raise ParallelismError(
            f"{_KEY['layers_per_stage']}={layers_per_stage} cuts {n_layers} layers + embedding + head into "
            f"{num_stages} stages, not a multiple of {_KEY['pp']}={pp} "
            f"(valid: {_layers_per_stage_hint(units, pp, range(1, units + 1))})"
        )
    return num_stages, f"{_KEY['layers_per_stage']}={layers_per_stage}"


def _check_stages_per_rank(schedule: str, pp: int, num_stages: int, source: str, units: int) -> None:
    per_rank = num_stages // pp
    if schedule in SINGLE_STAGE_SCHEDULES and per_rank != 1:
        raise ParallelismError(
            f"{_KEY['schedule']}={schedule} runs one stage per rank, but {source} gives {num_stages} stages for "
            f"{_KEY['pp']}={pp} (valid: a multi-stage schedule such as Interleaved1F1B, or "
            f"{_layers_per_stage_hint(units, pp, [1])})"
        )
    if schedule in V_SCHEDULES and per_rank != 2:
        raise ParallelismError(
            f"{_KEY['schedule']}={schedule} needs exactly 2 stages per rank, but {source} gives {num_stages} stages "
            f"for {_KEY['pp']}={pp} (valid: {_layers_per_stage_hint(units, pp, [2])})"
        )
    if schedule not in SINGLE_STAGE_SCHEDULES and per_rank < 2:
        raise ParallelismError(
            f"{_KEY['schedule']}={schedule} interleaves several stages per rank, but {source} gives {num_stages} "
            f"stages for {_KEY['pp']}={pp} (valid: GPipe or 1F1B, or "
            f"{_layers_per_stage_hint(units, pp, range(2, units + 1))})"
        )


def check_microbatches(schedule: str, pp: int, num_stages: int, n_microbatches: int, sizes: str) -> None:
    """The schedules' own requirements on the number of microbatches, as config errors instead of torch's."""
    if schedule == "1F1B" and n_microbatches < num_stages:
        raise ParallelismError(
            f"1F1B needs at least as many microbatches as stages ({num_stages}), got {n_microbatches} = {sizes} "
            f"(valid: a larger {_KEY['local_batch']} or a smaller {_KEY['microbatch']}, or GPipe)"
        )
    if schedule == "DualPipeV" and n_microbatches < num_stages:
        raise ParallelismError(
            f"DualPipeV needs at least as many microbatches as stages ({num_stages}), got {n_microbatches} = {sizes} "
            f"(valid: a larger {_KEY['local_batch']} or a smaller {_KEY['microbatch']}, or ZBVZeroBubble)"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ParallelismError(
                f"{schedule} runs microbatches in rounds of {_KEY['pp']}={pp}; {n_microbatches} = {sizes} "
                f"microbatches do not fill {rounds} rounds (valid: at most {pp}, or a multiple of {pp})"
            )


def _stages(
    schedule: str,
    pp: int,
    decoder: DecoderLayout,
    n_layers: int,
    layers_per_stage: int | None,
    stage_modules: Sequence[str] | Sequence[Sequence[str]] | None,
) -> tuple[list[list[str]], str]:
    """The module names of every stage, and the setting that decided the split (for messages)."""
    if stage_modules:
        if layers_per_stage is not None:
            raise ParallelismError(f"set {_KEY['modules']} or {_KEY['layers_per_stage']}, not both")
        stages = parse_stage_modules(stage_modules)
        _check_stage_modules(stages, decoder, n_layers)
        if len(stages) % pp:
            raise ParallelismError(f"{_KEY['modules']} lists {len(stages)} stages, not a multiple of {_KEY['pp']}={pp}")
        return stages, _KEY["modules"]
    num_stages, source = _num_stages(schedule, pp, n_layers, layers_per_stage)
    units = n_layers + 2
    if num_stages > units:
        raise ParallelismError(
            f"{source} asks for {num_stages} stages, but the model has only {units} units to split "
            f"({n_layers} layers + embedding + head) (valid: {_KEY['pp']} <= {units // (num_stages // pp)})"
        )
    return even_split(decoder, n_layers, num_stages), source


def _check_tied_embeddings(stages: list[list[str]], decoder: DecoderLayout) -> None:
    first = next(i for i, names in enumerate(stages) if decoder.embedding in names)
    last = next(i for i, names in enumerate(stages) if decoder.head in names)
    if first != last:
        raise ParallelismError(
            f"{_KEY['tie']}=true shares one weight between {decoder.embedding} (stage {first}) and {decoder.head} "
            f"(stage {last}), and pipeline stages cannot share parameters (valid: {_KEY['tie']}=false)"
        )


def plan_pipeline(
    *,
    pp: int,
    schedule: str,
    decoder: DecoderLayout,
    n_layers: int,
    local_batch_size: int,
    microbatch_size: int = 1,
    layers_per_stage: int | None = None,
    stage_modules: Sequence[str] | Sequence[Sequence[str]] | None = None,
    tie_word_embeddings: bool = False,
    fsdp_reshard_after_forward: str = "default",
    ddp: bool = False,
) -> PipelinePlan:
    """Check the pipeline keys against the model and the batch and return the plan; a one-line error otherwise.

    `decoder` names the model's parts (its class's ``decoder_layout``). `stage_modules` is
    ``parallelism.module_fqns_per_model_part``: one entry per stage (a list of full-model module names, or one
    string of space-separated names); empty or None means the default split. `ddp` says
    that data parallelism is plain DDP (replicas without FSDP), which pipelines cannot use.
    """
    if pp < 2:
        raise ParallelismError(f"{_KEY['pp']}={pp}: a pipeline needs at least 2 ranks")
    if ddp:
        # DDP's gradient hooks expect each forward to be followed by its backward; a pipeline runs several
        # forwards first, and the gradients come out wrong (by 1-2% on the loss, without an error).
        raise ParallelismError(
            f"{_KEY['pp']}={pp} cannot be combined with DDP ({_KEY['replicate']} > 1 alone) (valid: "
            f"{_KEY['shard']} > 1 for FSDP2, or HSDP with both)"
        )
    schedule = canonical_schedule_name(schedule)
    stages, source = _stages(schedule, pp, decoder, n_layers, layers_per_stage, stage_modules)
    _check_stages_per_rank(schedule, pp, len(stages), source, n_layers + 2)
    if tie_word_embeddings:
        _check_tied_embeddings(stages, decoder)
    if microbatch_size < 1 or local_batch_size % microbatch_size:
        raise ParallelismError(
            f"{_KEY['local_batch']}={local_batch_size} is not a multiple of {_KEY['microbatch']}={microbatch_size}"
        )
    n_microbatches = local_batch_size // microbatch_size
    sizes = f"{_KEY['local_batch']}={local_batch_size} / {_KEY['microbatch']}={microbatch_size}"
    check_microbatches(schedule, pp, len(stages), n_microbatches, sizes)
    if schedule in SPLIT_BACKWARD_SCHEDULES and fsdp_reshard_after_forward == "always":
        # torch 2.13: with the weight-gradient pass deferred, FSDP2 resharding after forward gives wrong
        # gradients silently; build_pipeline turns resharding off, so an explicit request cannot be honoured.
        raise ParallelismError(
            f"{_KEY['reshard']}=always cannot be combined with {_KEY['schedule']}={schedule}, whose deferred "
            f"weight-gradient pass needs the gathered parameters (valid: default or never)"
        )
    return PipelinePlan(
        schedule=schedule,
        pp=pp,
        stage_modules=tuple(tuple(names) for names in stages),
        n_microbatches=n_microbatches,
        microbatch_size=microbatch_size,
        decoder=decoder,
    )
