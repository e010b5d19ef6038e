"""CheckpointManager: the trainer's one handle on checkpoints (start-up restore, periodic/last/preemption saves).

Typical use, all ranks alike:

    manager = CheckpointManager(cfg.checkpoint, run_dir, world.rank, world.world_size, state,
                                training=cfg.training, parallelism=cfg.parallelism, model=cfg.model,
                                optimizer=cfg.optimizer, model_args=args)
    manager.restore_at_startup()                        # resume / initial load / scratch, logged
    while state.step < cfg.training.steps:
        train_step(...)
        stop = watcher.should_stop(state.step)
        manager.maybe_save(state.step, last=state.step == cfg.training.steps, preempted=stop)
        if stop: break
    manager.close()                                     # waits for an async save in flight and commits it
"""

from __future__ import annotations

import datetime
import logging
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dtrain.checkpoint import dcp_io
from dtrain.checkpoint.config_checks import model_record
from dtrain.checkpoint.context import RunContext
from dtrain.checkpoint.folders import (
    DELETING_SUFFIX,
    HF_KIND,
    CommitRecord,
    DamagedCheckpoint,
    commit,
    partial_dir,
    prune,
    remove_partials,
    scan_checkpoints,
    step_dir,
)
from dtrain.checkpoint.lora_base import lora_record
from dtrain.checkpoint.peft_names import is_lora
from dtrain.checkpoint.restore import Startup, restore_at_startup
from dtrain.checkpoint.save_failures import save_failed
from dtrain.config.schema import Checkpoint, LoRA, Model, Optimizer, Parallelism, Training
from dtrain.errors import DtrainError
from dtrain.models.decoder import DecoderArgs
from dtrain.step.optimizer import param_grouping
from dtrain.step.state import TrainState

logger = logging.getLogger("dtrain")


@dataclass
class _PendingSave:
    """An async save being written in the background, to be committed once it completes."""

    future: Future
    partial: Path
    final: Path
    record: CommitRecord
    started: float


class CheckpointManager:
    """Saves and restores `state` under `<run_dir>/<checkpoint.folder>` (see docs/checkpointing.md).

    Must be constructed on every rank at the same point (it creates a gloo process group when distributed).
    `checkpoint` has passed `check_checkpoint_config` (the pre-flight runs it); the other sections are those the
    checkpoints record and restore checks (see `RunContext`). `model_args` are the model family's args, needed to
    load Hugging Face weights; `lora` the [lora] section (a LoRA run's checkpoints may hold its adapters only:
    lora_base.py).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        run_dir: Path | str,
        world_rank: int,
        world_size: int,
        state: TrainState,
        *,
        training: Training,
        parallelism: Parallelism,
        model: Model,
        optimizer: Optimizer,
        model_args: DecoderArgs | None = None,
        lora: LoRA | None = None,
    ):
        group = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        folder = Path(run_dir) / checkpoint.folder
        self.ctx = RunContext(
            checkpoint, training, parallelism, model, optimizer, folder, state, world_rank, world_size, group,
            model_args, lora,
        )
        self.cfg = checkpoint
        self.folder = folder
        self._async = None
        self._staging: Future | None = None
        self._hook = None
        if self.cfg.async_mode != "disabled":
            self._async = dcp_io.AsyncSaver(self.cfg.async_mode == "async_with_pinned_mem", group)
            # The state is copied in the background while the next step computes; it must be complete before
            # the optimizer changes the weights.
            self._hook = state.optimizer.register_step_pre_hook(self._finish_staging)
        self._pending: _PendingSave | None = None
        # Seconds the training loop waited for the latest save: all of it when synchronous; when async, the call
        # plus any wait for the background copy before the next optimizer step.
        self.last_blocked_s = 0.0

    # -- start-up -----------------------------------------------------------------------------------------------
    def restore_at_startup(self) -> Startup:
        """Resume, initial-load or start from scratch by the start-up rule; logs which, returns a `Startup`.

        Then (the run is accepted) rank 0 deletes the leftovers of saves that never committed.
        """
        startup = restore_at_startup(self.ctx)
        # A load_only run writes nothing into the checkpoint folder, not even a cleanup.
        if self.cfg.enable and not self.cfg.load_only and self.ctx.rank == 0:
            for path in remove_partials(self.folder):
                cut_short = "a deletion (keep_latest_k)" if path.name.endswith(DELETING_SUFFIX) else "a save"
                logger.warning(f"checkpoint: removed {path}, left by {cut_short} that never completed")
        return startup

    # -- saving -------------------------------------------------------------------------------------------------
    def maybe_save(self, step: int, *, last: bool = False, preempted: bool = False) -> bool:
        """Call after every train step: saves on the interval, at the last step, when preempted, and after step 1
        with checkpoint.enable_first_step_checkpoint; never with checkpoint.load_only.

        The last save holds only the weights (in checkpoint.export_dtype) when checkpoint.last_save_model_only, as
        Hugging Face safetensors when checkpoint.last_save_in_hf. Also commits an async save that finished
        meanwhile. Returns whether a save started.
        """
        self._commit_if_done()
        if not self.cfg.enable or self.cfg.load_only:
            if preempted:
                key = "checkpoint.load_only is true" if self.cfg.enable else "checkpoint.enable is false"
                logger.warning(f"{key}: stopping without a checkpoint")
            return False
        if not self.save_due(step, last=last, preempted=preempted):
            return False
        if last and self.cfg.last_save_in_hf:
            self.save_hf(step)
        else:
            self.save(step, model_only=last and self.cfg.last_save_model_only)
        return True

    def save_due(self, step: int, *, last: bool = False, preempted: bool = False) -> bool:
        """Whether `maybe_save` saves after `step` (so the trainer can check the state first)."""
        first = step == 1 and self.cfg.enable_first_step_checkpoint
        due = last or preempted or first or step % self.cfg.interval == 0
        return self.cfg.enable and not self.cfg.load_only and due

    def save(self, step: int, *, model_only: bool = False, dtype: str | None = None, blocking: bool = False) -> None:
        """Save the state (or only the weights, in `dtype` or checkpoint.export_dtype) as step-`step`."""
        self._wait_and_commit()
        state = self.ctx.state
        partial, final = self._open_folder(step)
        dtype = dtype or self.cfg.export_dtype
        if model_only:
            state_dict = self._saved_weights(dcp_io.export_weights(state.model_parts, dcp_io.EXPORT_DTYPES[dtype]))
            weights = state_dict
        else:
            state_dict = state.state_dict()
            weights = state_dict[dcp_io.MODEL_KEY] = self._saved_weights(state_dict[dcp_io.MODEL_KEY])
        record = self._record(step, "model_only" if model_only else "full", weights)
        started = time.perf_counter()
        if self._async is not None and not blocking:
            try:
                self._staging, future = self._async.start(state_dict, partial)
            except (Exception, CheckpointException) as err:
                raise save_failed(partial, "async save", err) from None
            self.last_blocked_s = time.perf_counter() - started
            self._pending = _PendingSave(future, partial, final, record, started)
            return
        try:
            dcp_io.save(state_dict, partial)
        except (Exception, CheckpointException) as err:
            raise save_failed(partial, "save", err) from None
        self._commit(partial, final, record, started)
        self.last_blocked_s = time.perf_counter() - started

    def _saved_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds: a LoRA run that started from a base checkpoint keeps only the adapters
        (and a reference to the base: lora_base.py)."""
        if self.ctx.base is None:
            return weights
        return {fqn: tensor for fqn, tensor in weights.items() if is_lora(fqn)}

    def save_hf(self, step: int) -> None:
        """Save the weights as Hugging Face safetensors with config.json, in checkpoint.export_dtype, as step-`step`;
        a LoRA run's with every adapter merged into its base weight (peft_export.py).

        Every rank first writes its shards as DCP inside the folder (any layout, pipeline stages included); rank 0
        then reads them back whole and writes the safetensors, as scripts/convert_checkpoint.py to-hf does. Always
        blocking: it is the run's last save, and the process exits after it.
        """
        from dtrain.checkpoint.hf_io import build_adapter, save_hf, token_ids
        from dtrain.checkpoint.peft_export import save_merged_hf

        self._wait_and_commit()
        partial, final = self._open_folder(step)
        dtype = dcp_io.EXPORT_DTYPES[self.cfg.export_dtype]
        weights = dcp_io.export_weights(self.ctx.state.model_parts, dtype)
        record = self._record(step, HF_KIND, weights)
        shards = partial / "dcp"
        started = time.perf_counter()
        try:
            dcp_io.save(weights, shards)
            if self.ctx.rank == 0:
                adapter = build_adapter(self.ctx.model.name, self.ctx.model_args)
                tokens = token_ids(self.ctx.model, self.cfg)
                full = dcp_io.read_full_weights(shards)
                if self.ctx.lora is not None and self.ctx.lora.enable:
                    save_merged_hf(full, partial, adapter, self.ctx.lora, dtype, special_tokens=tokens)
                else:
                    save_hf(full, partial, adapter, dtype, special_tokens=tokens)
                shutil.rmtree(shards)
        except (Exception, CheckpointException) as err:
            raise save_failed(partial, "Hugging Face save", err) from None
        self._commit(partial, final, record, started)
        self.last_blocked_s = time.perf_counter() - started

    def _open_folder(self, step: int) -> tuple[Path, Path]:
        """(partial, final) folders of a save of `step`: the partial one freshly created, seen by every rank."""
        partial, final = partial_dir(self.folder, step), step_dir(self.folder, step)
        if self.ctx.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash in an earlier attempt at this step
            try:
                partial.mkdir(parents=True)
            except OSError as err:  # the folder turned read-only, or full, or lost to permissions mid-run
                raise save_failed(partial, "save", err) from None
        if self.ctx.group is not None:
            dist.barrier(group=self.ctx.group)
        return partial, final

    def _record(self, step: int, kind: str, weights: dict[str, torch.Tensor]) -> CommitRecord:
        ctx, state = self.ctx, self.ctx.state
        return CommitRecord(
            step=step,
            kind=kind,
            tokens_seen=state.tokens_seen,
            seed=state.setup.seed,
            dtype=str(next(iter(weights.values())).dtype).removeprefix("torch."),
            world_size=ctx.world_size,
            parallelism=ctx.parallel_degrees(),
            data=ctx.data_layout(),
            saved_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch_version=torch.__version__,
            tie_word_embeddings=getattr(ctx.model_args, "tie_word_embeddings", None),
            optimizer=ctx.optimizer.name if kind == "full" else "",
            optimizer_grouping=param_grouping(ctx.optimizer) if kind == "full" else "",
            model=model_record(ctx.model, ctx.model_args),
            lora=lora_record(ctx.lora, ctx.base),
        )

    def save_seed_checkpoint(self) -> Path:
        """Save the freshly initialised weights (float32) as step-0 and return its folder (one process only)."""
        scan = scan_checkpoints(self.folder)
        if scan.committed or scan.incomplete:
            raise DtrainError(
                f"{self.folder} already holds checkpoints; create the seed checkpoint with a new job.dump_folder"
            )
        self.save(0, model_only=True, dtype="float32", blocking=True)
        path = step_dir(self.folder, 0)
        logger.info(
            f"checkpoint: seed checkpoint written to {path}; start runs (any layout) with this job.dump_folder "
            f"and checkpoint.enable, or with checkpoint.initial_load_path = {path}"
        )
        return path

    def wait(self) -> None:
        """Block until an async save still being written is on disk, and commit it."""
        self._wait_and_commit()

    def close(self) -> None:
        """Wait for an async save still being written, commit it, and release the staging buffers."""
        try:
            self._wait_and_commit()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._async is not None:
                self._async.close()
                self._async = None

    # -- committing ---------------------------------------------------------------------------------------------
    def _finish_staging(self, *_hook_args) -> None:
        """Optimizer pre-hook: wait until the background copy of the state is complete (usually it already is)."""
        staging, self._staging = self._staging, None
        if staging is None:
            return
        started = time.perf_counter()
        try:
            staging.result()
        except (Exception, CheckpointException) as err:
            raise DtrainError(f"checkpoint: async staging failed: {dcp_io.failure_summary(err)}") from None
        self.last_blocked_s += time.perf_counter() - started

    def _commit_if_done(self) -> None:
        if self._pending is not None and self._pending.future.done():
            self._wait_and_commit()

    def _wait_and_commit(self) -> None:
        self._finish_staging()
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result()
        except (Exception, CheckpointException) as err:
            raise save_failed(pending.partial, "async save", err) from None
        self._commit(pending.partial, pending.final, pending.record, pending.started, background=True)

    def _commit(self, partial: Path, final: Path, record: CommitRecord, started: float, background=False) -> None:
        """Rank 0 verifies and renames the written folder, then applies retention (DCP has finished on all ranks)."""
        if self.ctx.rank != 0:
            return
        try:
            commit(partial, final, record)
        except DamagedCheckpoint as err:
            raise DtrainError(f"checkpoint step-{record.step} failed verification after writing: {err}") from None
        except OSError as err:  # the record or the rename refused (say, the folder turned read-only): not committed
            raise save_failed(partial, "commit", err) from None
        removed = prune(self.folder, self.cfg.keep_latest_k, keep=final)
        kind = f"weights only, {record.dtype}" if record.model_only else "full state"
        if record.kind == HF_KIND:
            kind = f"Hugging Face safetensors, {record.dtype}"
        if record.lora.get("base"):
            kind += f"; LoRA adapters only, the frozen base is {record.lora['base']['path']}"
        how = f" in the background, training blocked {self.last_blocked_s:.2f} s" if background else ""
        logger.info(
            f"checkpoint: saved {final} ({kind}) in {time.perf_counter() - started:.2f} s{how}"
            + (f"; removed {', '.join(p.name for p in removed)}" if removed else "")
        )
