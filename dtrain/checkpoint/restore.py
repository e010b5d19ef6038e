"""The start-up rule: resume the run directory's checkpoint, else restore checkpoint.initial_load_path, else start
from scratch (or fail, with checkpoint.require_checkpoint). Rank 0 decides; every rank then loads.

1. resume:       <run>/<checkpoint.folder> holds a committed checkpoint → the whole TrainState of the newest one
                 (or of checkpoint.load_step), minus checkpoint.exclude_from_loading.
2. initial_load: else checkpoint.initial_load_path is set → its weights (the whole state with
                 initial_load_model_only = false), DCP or Hugging Face safetensors; the run saves into its own folder.
3. scratch:      else the freshly initialised state.

A LoRA run's adapter-only checkpoint (lora_base.py) loads its frozen base from the reference it records first; a
LoRA run's initial load may add the adapters of a PEFT folder (lora.initial_adapter_path; lora_start.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.checksums import ChecksumMismatch
from dtrain.checkpoint.config_checks import check_resume_changes
from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.folders import (
    COMMIT_FILE,
    HF_KIND,
    CommitRecord,
    DamagedCheckpoint,
    is_dcp_checkpoint,
    read_record,
    scan_checkpoints,
)
from dtrain.checkpoint.load_checks import first_non_finite, fitting_weights
from dtrain.checkpoint.lora_base import check_lora_settings
from dtrain.checkpoint.lora_start import load_base, lora_weights, start_lora
from dtrain.checkpoint.optimizer_checks import (
    check_grouping,
    check_param_groups,
    group_settings,
    group_values,
    restore_group_settings,
)
from dtrain.checkpoint.safe_reading import UnsafeCheckpoint
from dtrain.checkpoint.spellings import (
    family_spellings,
    find_spelling,
    model_fqns,
    whole_tensor_batches,
)
from dtrain.errors import DtrainError
from dtrain.models.decoder import DecoderArgs
from dtrain.models.family import WeightSpelling
from dtrain.precision.low_bit_optim import low_bit_suffix
from dtrain.step.optimizer import param_grouping

logger = logging.getLogger("dtrain")
FALLBACK_HINT = "set checkpoint.fallback_to_previous = true to resume from the previous complete checkpoint"


class LoadFailed(DtrainError):
    """Reading a checkpoint that looked intact failed; with fallback_to_previous the one before it is tried."""


@dataclass(frozen=True)
class Startup:
    """What restore_at_startup did: the rule that fired ("resume", "initial_load", "scratch"), from where, and
    the step training continues after."""

    rule: str
    step: int = 0
    path: Path | None = None
    model_only: bool = False

    def describe(self) -> str:
        if self.rule == "scratch":
            return "checkpoint: starting from scratch (no checkpoint to resume, no checkpoint.initial_load_path)"
        what = "weights only" if self.model_only else "full training state"
        if self.rule == "resume":
            return f"checkpoint: resuming from {self.path} ({what}) at step {self.step}"
        return f"checkpoint: initial load from {self.path} ({what}); continuing as a new run at step {self.step}"


@dataclass(frozen=True)
class _Plan:
    """Rank 0's decision, sent to every rank."""

    rule: str
    path: Path | None = None
    record: CommitRecord | None = None
    source: str = "dcp"  # or "hf": safetensors (checkpoint.initial_load_in_hf, or a last_save_in_hf folder)
    model_only: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


def restore_at_startup(ctx: RunContext) -> Startup:
    """Apply the start-up rule to `ctx.state`, log which rule fired, and return it. Errors are one-line DtrainErrors."""
    failed: set[Path] = set()
    while True:
        plan = ctx.agree(lambda: _choose(ctx, failed))
        for note in plan.notes:
            logger.warning(note)
        if plan.rule == "scratch":
            startup = Startup("scratch")
            break
        try:
            _apply(ctx, plan)
        except LoadFailed as err:
            c = ctx.checkpoint
            if plan.rule == "resume" and c.fallback_to_previous and c.load_step < 0:
                logger.warning(f"{err}; falling back to the previous complete checkpoint")
                failed.add(plan.path)
                continue
            hint = f"; {FALLBACK_HINT}" if plan.rule == "resume" and c.load_step < 0 else ""
            raise LoadFailed(f"{err}{hint}") from None
        startup = Startup(plan.rule, ctx.state.step, plan.path, plan.model_only)
        break
    if ctx.lora is not None and ctx.lora.enable and ctx.lora.quantize_base:
        from dtrain.precision.qlora import quantize_base_weights  # QLoRA quantizes the weights just loaded

        quantize_base_weights(ctx.state.model_parts)
    logger.info(startup.describe())
    if startup.rule == "resume" and startup.step >= ctx.training.steps:
        logger.info(f"checkpoint: the run already reached training.steps = {ctx.training.steps}; nothing to train")
    return startup


def _choose(ctx: RunContext, failed: set[Path]) -> _Plan:
    c = ctx.checkpoint
    scan = scan_checkpoints(ctx.folder)
    notes = []
    if scan.incomplete:
        notes.append(
            f"checkpoint: ignoring incomplete checkpoint folder(s) without a commit record in {ctx.folder}: "
            f"{scan.describe_incomplete()}"
        )
    if c.enable:
        found = _newest_resumable(ctx, scan.committed, failed, notes)
        if found is not None:
            path, record = found
            return _Plan("resume", path, record, _source(record), record.model_only, tuple(notes))
    elif scan.committed:
        notes.append(f"checkpoint.enable is false: not resuming from the checkpoint(s) in {ctx.folder}")
    if c.initial_load_path:
        return _initial_load_plan(ctx, notes)
    if c.require_checkpoint:
        raise DtrainError(
            f"checkpoint.require_checkpoint is set, but {ctx.folder} holds no complete checkpoint"
            + ("" if c.enable else " that may be resumed (checkpoint.enable is false)")
            + " and checkpoint.initial_load_path is empty"
        )
    return _Plan("scratch", notes=tuple(notes))


def _newest_resumable(ctx, committed, failed, notes) -> tuple[Path, CommitRecord] | None:
    """The checkpoint to resume: the newest intact one (or checkpoint.load_step's), as (path, record)."""
    c = ctx.checkpoint
    candidates = [entry for entry in reversed(committed) if entry.path not in failed]
    if failed and not candidates:
        # Falling back must end at an intact checkpoint, never at a silent fresh start.
        raise DtrainError(
            f"no checkpoint in {ctx.folder} could be loaded (tried {', '.join(p.name for p in sorted(failed))})"
        )
    if c.load_step >= 0:
        candidates = [entry for entry in candidates if entry.step == c.load_step]
        if not candidates:
            steps = ", ".join(str(entry.step) for entry in committed) or "none"
            raise DtrainError(
                f"checkpoint.load_step = {c.load_step}: {ctx.folder} holds no complete checkpoint step-{c.load_step} "
                f"(complete steps: {steps})"
            )
    skipped = []
    for position, entry in enumerate(candidates):
        try:
            record = read_record(entry.path)
        except DamagedCheckpoint as err:
            has_previous = position + 1 < len(candidates)
            if c.fallback_to_previous and c.load_step < 0 and has_previous:
                notes.append(f"checkpoint {entry.path} is damaged ({err}); falling back to the previous one")
                continue
            hint = FALLBACK_HINT if has_previous and c.load_step < 0 else "remove it to start over"
            raise DtrainError(f"checkpoint {entry.path} is damaged: {err}; {hint}") from None
        total = ctx.training.steps
        if record.model_only and (0 < record.step < total or skipped):
            # Weights alone cannot continue a run mid-way (optimizer, schedule and data position are missing);
            # nor may a run that went past its seed checkpoint silently start over from it.
            skipped.append(entry.path)
            continue
        if skipped:
            notes.append(f"checkpoint: skipping model-only {', '.join(p.name for p in skipped)} (weights only)")
        return entry.path, record
    if skipped:
        raise DtrainError(
            f"{ctx.folder} holds only model-only checkpoints before training.steps = {ctx.training.steps} "
            f"({', '.join(p.name for p in skipped)}), which cannot resume a run; start a new run from one with "
            "checkpoint.initial_load_path (and a new job.dump_folder)"
        )
    return None


def _initial_load_plan(ctx: RunContext, notes: list[str]) -> _Plan:
    c = ctx.checkpoint
    path = Path(c.initial_load_path)
    key = "checkpoint.initial_load_path"
    if not path.exists():
        raise DtrainError(f"{key} {path} does not exist")
    if c.initial_load_in_hf:
        from dtrain.checkpoint.hf_io import safetensors_index

        safetensors_index(path)  # readable safetensors, or a one-line error now rather than while loading
        return _Plan("initial_load", path, source="hf", model_only=True, notes=tuple(notes))
    if path.is_file():
        raise DtrainError(
            f"{key} {path} is a file; expected a DCP checkpoint folder (for safetensors set "
            "checkpoint.initial_load_in_hf = true)"
        )
    if not is_dcp_checkpoint(path) and not (path / COMMIT_FILE).is_file():
        committed = scan_checkpoints(path).committed
        if committed:
            path = committed[-1].path
        elif not any(path.iterdir()):
            raise DtrainError(f"{key} {path} is an empty folder")
        else:
            raise DtrainError(
                f"{key} {path} is neither a DCP checkpoint (no .metadata) nor a folder of committed step-N checkpoints"
            )
    record = None
    try:
        if (path / COMMIT_FILE).exists():
            record = read_record(path)
        else:
            dcp_io.read_tensor_shapes(path)
    except DamagedCheckpoint as err:
        raise DtrainError(f"{key} {path} is damaged: {err}") from None
    except Exception as err:
        raise DtrainError(f"{key} {path} cannot be read ({type(err).__name__}: {err})") from None
    if record is None:
        notes.append(f"checkpoint: {path} has no {COMMIT_FILE}: a checkpoint from elsewhere, read without checksums")
    elif c.initial_load_writer == "torchtitan":
        raise DtrainError(
            f"{key} {path} has dtrain's {COMMIT_FILE}, so torchtitan did not write it; set "
            "checkpoint.initial_load_writer to auto or dtrain"
        )
    if not c.initial_load_model_only:
        if record is None:
            raise DtrainError(
                f"{key} {path} has no {COMMIT_FILE}, so it is not a dtrain checkpoint whose full state can be loaded; "
                "set checkpoint.initial_load_model_only = true to load its weights"
            )
        if record.model_only:
            raise DtrainError(
                f"{key} {path} holds weights only; set checkpoint.initial_load_model_only = true"
            )
    return _Plan("initial_load", path, record, _source(record), c.initial_load_model_only, tuple(notes))


def _source(record: CommitRecord | None) -> str:
    """How a committed checkpoint is read: a checkpoint.last_save_in_hf save is safetensors, the others DCP."""
    return "hf" if record is not None and record.kind == HF_KIND else "dcp"


def _apply(ctx: RunContext, plan: _Plan) -> None:
    record = plan.record
    if record is not None and plan.rule == "resume":
        check_resume_changes(ctx, plan.path, record)  # another model, seq_len or batch: config_checks.py says why
        check_lora_settings(plan.path, record.lora, ctx.lora)
    # An adapter-only checkpoint of a LoRA run: its frozen base first, from where the run read it (lora_base.py).
    base = record.lora.get("base") if record is not None and record.lora else None
    if base is not None:
        load_base(ctx, plan.path, base, load_weights)
    if record is not None:
        check_tying(plan.path, record, ctx.model_args)
    if record is not None and (record.world_size, record.parallelism) != (ctx.world_size, ctx.parallel_degrees()):
        logger.info(
            f"checkpoint: saved by {record.world_size} rank(s) with {_degrees(record.parallelism)}, loading into "
            f"{ctx.world_size} with {_degrees(ctx.parallel_degrees())}: DCP reshards"
        )
    if plan.source == "hf":
        from dtrain.checkpoint.hf_io import build_adapter, load_hf_weights

        load_hf_weights(ctx.state.model_parts, plan.path, build_adapter(ctx.model.name, ctx.model_args), ctx.group)
    elif plan.model_only:
        # Only a checkpoint from elsewhere (no commit record) may spell the weights otherwise; dtrain's are ours.
        foreign = plan.rule == "initial_load" and record is None
        spellings = family_spellings(ctx.model.name, ctx.model_args) if foreign else ()
        writer = ctx.checkpoint.initial_load_writer if foreign else "dtrain"
        partial = plan.rule == "initial_load" and ctx.checkpoint.initial_load_partial
        load_weights(ctx, plan.path, spellings, writer, adapters_only=base is not None, partial=partial)
    else:
        load_full_state(ctx, plan.path, plan.record, adapters_only=base is not None)
    if ctx.lora is not None and ctx.lora.enable:
        start_lora(ctx, plan.rule, plan.path, plan.source, base)
    if plan.model_only and plan.rule == "resume" and record is not None and record.step > 0:
        # A finished run's final model-only save: nothing is left to train, so only the counters move.
        ctx.state.step, ctx.state.tokens_seen = record.step, record.tokens_seen


def check_tying(path: Path, record: CommitRecord, model_args: DecoderArgs | None) -> None:
    """Refuse weights saved tied into an untied model and the reverse: names and shapes match either way, and
    the load would silently merge two weights into one or copy one into two."""
    saved, ours = record.tie_word_embeddings, getattr(model_args, "tie_word_embeddings", None)
    if saved is None or ours is None or saved == ours:
        return
    effect = "keep only one of its two weights" if ours else "copy its one shared weight into two"
    raise DtrainError(
        f"checkpoint {path} was saved with tie_word_embeddings {str(saved).lower()}, this model has "
        f"{str(ours).lower()}: loading it would {effect}; set model.tie_word_embeddings = {str(saved).lower()}"
    )


def _degrees(parallelism: dict) -> str:
    shown = {k.replace("_parallel", "").replace("_degree", ""): v for k, v in parallelism.items() if v != 1}
    return ", ".join(f"{k} {v}" for k, v in shown.items()) or "no parallelism"


def load_weights(
    ctx: RunContext, path: Path, spellings: tuple[WeightSpelling, ...] = (), writer: str = "dtrain",
    adapters_only: bool = False, partial: bool = False,
) -> None:
    """Load the model weights (resharded to this layout) from a full or model-only DCP checkpoint, named as ours
    or as one of `spellings`, as `writer` (checkpoint.initial_load_writer) and the names decide (spellings.py).

    Only LoRA adapters when `adapters_only`; adapters a checkpoint lacks (a base model's) keep their init. Any other
    weight the checkpoint holds and the model does not take, or the reverse, is refused unless `partial`
    (checkpoint.initial_load_partial; load_checks.py); so is a NaN or Inf in a loaded weight."""
    shapes = dcp_io.read_tensor_shapes(path)
    prefix = dcp_io.weights_prefix(shapes)
    weights = lora_weights(dcp_io.model_state_dict(ctx.state.model_parts), shapes, prefix, adapters_only)
    whole_model = model_fqns(weights, ctx.group)
    spelling = None
    if spellings:
        spelling = find_spelling(shapes, prefix, whole_model, spellings, writer, path)
    name = spelling.stored_name if spelling else (lambda fqn: fqn)
    weights = fitting_weights(path, shapes, prefix, weights, whole_model, name, partial)
    dcp_io.check_weights_fit(path, shapes, prefix, weights, name)
    if spelling:
        logger.info(f"checkpoint: {path} names the weights as {spelling.writer} does")
    stored = {fqn: prefix + name(fqn) for fqn in weights}
    # Tensors stored as ours load straight into this rank's shards; the others are read whole and converted.
    as_stored = [fqn for fqn in weights if spelling is None or spelling.to_ours(fqn) is None]
    wanted = {stored[fqn]: weights[fqn] for fqn in as_stored}
    _load(ctx, wanted, path)
    loaded = {fqn: wanted[stored[fqn]] for fqn in as_stored}
    for batch in whole_tensor_batches([fqn for fqn in weights if fqn not in loaded], weights, ctx.group):
        whole = {stored[fqn]: torch.empty(shapes[stored[fqn]], dtype=weights[fqn].dtype) for fqn in batch}
        _load(ctx, whole, path)
        for fqn in batch:
            loaded[fqn] = dcp_io.place_like(spelling.to_ours(fqn)(whole[stored[fqn]]), weights[fqn])
    bad = first_non_finite(loaded, whole_model, ctx.group)
    if bad is not None:
        raise DtrainError(f"checkpoint {path}: {prefix}{name(bad)} holds NaN or Inf values; a checkpoint to start "
                          "from must be finite (was it saved from a diverged run, or damaged?)")
    dcp_io.set_model_weights(ctx.state.model_parts, loaded)


def load_full_state(ctx: RunContext, path: Path, record: CommitRecord, adapters_only: bool = False) -> None:
    """Load the whole TrainState from `path` except checkpoint.exclude_from_loading, resharding as needed (of the
    weights only the LoRA adapters when `adapters_only`)."""
    state = ctx.state
    exclude = set(ctx.checkpoint.exclude_from_loading)
    if "dataloader" not in exclude:
        check_data_layout(ctx, path, record)
    if "optimizer" not in exclude:
        check_optimizer(path, record.optimizer, ctx.optimizer.name)
        check_grouping(path, record.optimizer_grouping, param_grouping(ctx.optimizer))
    current = state.state_dict()
    shapes = dcp_io.read_tensor_shapes(path)
    current[dcp_io.MODEL_KEY] = lora_weights(current[dcp_io.MODEL_KEY], shapes, f"{dcp_io.MODEL_KEY}.", adapters_only)
    # The optimizer's state is per weight, so a whole state loads only into the model it was saved from.
    fitting_weights(path, shapes, f"{dcp_io.MODEL_KEY}.", current[dcp_io.MODEL_KEY],
                    model_fqns(current[dcp_io.MODEL_KEY], ctx.group), lambda fqn: fqn, partial=False,
                    way_out="a whole training state loads only into the model it was saved from")
    dcp_io.check_weights_fit(path, shapes, f"{dcp_io.MODEL_KEY}.", current[dcp_io.MODEL_KEY])
    wanted = {k: v for k, v in current.items() if k not in exclude}
    ours, settings = group_values(current[dcp_io.OPTIMIZER_KEY]), group_settings(state.optimizer)
    _load(ctx, wanted, path)
    saved_seed = wanted["train"]["seed"]
    seed = state.setup.seed
    if saved_seed != seed:
        raise DtrainError(
            f"checkpoint {path} was trained with debug.seed = {saved_seed}, this run has debug.seed = {seed}; "
            f"set --debug.seed {saved_seed} (seed and step are the run's random state)"
        )
    if "optimizer" not in exclude:
        # Before the state takes them: the load itself would put the checkpoint's hyperparameters in place.
        vectors = {fqn for fqn, weight in current[dcp_io.MODEL_KEY].items() if weight.ndim < 2}
        check_param_groups(path, record.optimizer_grouping, ctx.optimizer, ours,
                           wanted[dcp_io.OPTIMIZER_KEY], vectors)
    state.load_state_dict({**current, **wanted})
    restore_group_settings(state.optimizer, settings)
    if "optimizer" in exclude:
        # Reading the optimizer's state dict made DCP initialise it with one zero-gradient step; a fresh optimizer
        # has no state at all, so drop it (Adam's bias correction counts from its first real step).
        state.optimizer.state.clear()
    if exclude:
        logger.info(f"checkpoint: not loaded (checkpoint.exclude_from_loading): {', '.join(sorted(exclude))}")


def check_optimizer(path: Path, saved: str, ours: str) -> None:
    """Refuse optimizer state stored in another moment format (torch's float moments, torchao's 8-bit, 4-bit or
    float8 ones): DCP would load float moments into a low-bit optimizer whole, silently undoing its memory saving,
    and fail on the reverse with a message about metadata. Optimizers of one format (AdamW and Adam) share their
    state, so switching between them continues it, said in the log."""
    if not saved or saved == ours:  # "": a record from before dtrain recorded it
        return
    if low_bit_suffix(saved) != low_bit_suffix(ours):
        raise DtrainError(
            f"checkpoint {path} holds the optimizer state of optimizer.name = {saved} ({_moments(saved)} moments), "
            f"which {ours} ({_moments(ours)} moments) cannot continue: set optimizer.name = {saved}, or "
            'checkpoint.exclude_from_loading = ["optimizer"] to start the optimizer afresh'
        )
    logger.info(f"checkpoint: optimizer state saved by {saved} continues in {ours} (the same moment format)")


def _moments(name: str) -> str:
    return low_bit_suffix(name) or "float"


# What the data-layout keys added after the first release were, for checkpoints that predate them.
LAYOUT_DEFAULTS = {"dataset_mixture": [], "dataset_shuffle": True}


def check_data_layout(ctx: RunContext, path: Path, record: CommitRecord) -> None:
    """Refuse a data position that would not continue exactly; log when it carries over to a new dp size."""
    saved, now = record.data, ctx.data_layout()
    if not saved:
        return
    # Records written before a key existed hold its default.
    saved = {**LAYOUT_DEFAULTS, **saved}
    changed = [k for k in now if k != "dp_size" and saved.get(k) != now[k]]
    if changed:
        diffs = ", ".join(f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in changed)
        raise DtrainError(
            f"checkpoint {path}: its data position cannot continue exactly ({diffs}); keep them, or set "
            'checkpoint.exclude_from_loading = ["dataloader"] to start the data from the beginning'
        )
    if saved.get("dp_size") != now["dp_size"]:
        logger.info(
            f"checkpoint: data position carries over from {saved.get('dp_size')} to {now['dp_size']} data-parallel "
            f"rank(s) (global batch of {now['global_batch']} sequences unchanged)"
        )


def _load(ctx: RunContext, wanted: dict, path: Path) -> None:
    try:
        dcp_io.load(wanted, path)
    except (UnsafeCheckpoint, ChecksumMismatch, DamagedCheckpoint) as err:
        # Nothing ran; like any unreadable checkpoint it may be fallen back from (checkpoint.fallback_to_previous).
        raise LoadFailed(f"cannot load checkpoint {path}: {err}") from None
    except (Exception, CheckpointException) as err:
        if isinstance(err, DtrainError):
            raise
        raise LoadFailed(f"cannot load checkpoint {path}: {dcp_io.failure_summary(err)}") from None
