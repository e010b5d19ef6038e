"""Find what to load at start-up: rank 0's `Plan` under the start-up rule (restore.py), before anything is read.

resume: the run folder's newest intact committed checkpoint (or checkpoint.load_step's); initial_load:
checkpoint.initial_load_path (a DCP folder or a folder of step-N checkpoints, or Hugging Face safetensors);
scratch: neither. Damaged or unusable candidates are refused here in one line, or skipped with a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtrain.checkpoint import dcp_io
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
from dtrain.errors import DtrainError

FALLBACK_HINT = "set checkpoint.fallback_to_previous = true to resume from the previous complete checkpoint"


@dataclass(frozen=True)
class Plan:
    """Rank 0's decision, sent to every rank: the rule, what to read and how."""

    rule: str  # "resume", "initial_load" or "scratch"
    path: Path | None = None
    record: CommitRecord | None = None  # None: a checkpoint from elsewhere (no commit record)
    source: str = "dcp"  # or "hf": safetensors (checkpoint.initial_load_in_hf, or a last_save_in_hf folder)
    model_only: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def reads(self) -> str:
        """What is read: "hf" safetensors weights, DCP "weights" only, or the whole DCP training "state"."""
        return "hf" if self.source == "hf" else "weights" if self.model_only else "state"

    @property
    def foreign(self) -> bool:
        """An initial load of a checkpoint from elsewhere, which alone may spell the weights otherwise."""
        return self.rule == "initial_load" and self.record is None

    @property
    def lora_base(self) -> dict[str, Any] | None:
        """The frozen-base reference of a LoRA run's adapter-only checkpoint (lora_base.py), else None."""
        return self.record.lora.get("base") if self.record is not None and self.record.lora else None


def choose_plan(ctx: RunContext, failed: set[Path]) -> Plan:
    """The plan under the start-up rule, leaving out the checkpoints in `failed` (a fallback's earlier tries)."""
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
            return Plan("resume", path, record, _source(record), record.model_only, tuple(notes))
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
    return Plan("scratch", notes=tuple(notes))


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


def _initial_load_plan(ctx: RunContext, notes: list[str]) -> Plan:
    c = ctx.checkpoint
    path = Path(c.initial_load_path)
    key = "checkpoint.initial_load_path"
    if not path.exists():
        raise DtrainError(f"{key} {path} does not exist")
    if c.initial_load_in_hf:
        from dtrain.checkpoint.hf_io import safetensors_index

        safetensors_index(path)  # readable safetensors, or a one-line error now rather than while loading
        return Plan("initial_load", path, source="hf", model_only=True, notes=tuple(notes))
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
    return Plan("initial_load", path, record, _source(record), c.initial_load_model_only, tuple(notes))


def _source(record: CommitRecord | None) -> str:
    """How a committed checkpoint is read: a checkpoint.last_save_in_hf save is safetensors, the others DCP."""
    return "hf" if record is not None and record.kind == HF_KIND else "dcp"
