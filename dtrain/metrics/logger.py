"""Turns the train step's metric tensors into one console line, a metrics.jsonl record and TensorBoard scalars.

``train_step`` returns its metrics as 0-dim tensors without synchronizing with the host. ``MetricsLogger.log``
is the one place that reads them (once per log interval) and therefore the one host sync of the loop. Throughput
is measured by wall clock between log calls, over the whole logged window of steps.

Reported throughput follows torchtitan's convention: ``tps`` is tokens per second *per rank* (all ranks' tokens
divided by the number of ranks), so ``tflops`` and ``mfu`` are per-device figures whatever the parallel layout.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from dtrain.config.schema_observe import Metrics
from dtrain.metrics.console_color import colored, console_is_terminal
from dtrain.metrics.device_peaks import device_peak_flops
from dtrain.metrics.memory import peak_memory_gib
from dtrain.metrics.source_metrics import format_sources_line, source_fields
from dtrain.metrics.sinks import JsonlWriter, TensorBoardWriter, WandbWriter

logger = logging.getLogger(__name__)

# Fields the logger computes itself; a train-step metric may not reuse these names.
COMPUTED_FIELDS = ("step", "tps", "tflops", "mfu", "memory_gib", "elapsed_s", "eta_s", "tokens_seen")
# Train-step metrics shown on the console line; any other metric goes to metrics.jsonl and TensorBoard only.
LINE_METRICS = ("loss", "grad_norm", "lr")


def synchronize_device(device: torch.device) -> None:
    """Wait until ``device`` has finished all queued work, so wall-clock time covers it; a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


def read_metric_values(metrics: Mapping[str, torch.Tensor | float | int]) -> dict[str, float]:
    """Python floats of ``metrics``, copying tensors to the host once per device rather than once per tensor."""
    values = {name: float(value) for name, value in metrics.items() if not isinstance(value, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"metric {name!r} must be a single value, got a tensor of shape {tuple(value.shape)}")
            by_device.setdefault(value.device, []).append(name)
    for names in by_device.values():
        stacked = torch.stack([metrics[name].detach().reshape(()).to(torch.float64) for name in names])
        values.update(zip(names, stacked.tolist()))
    return {name: values[name] for name in metrics}


def format_duration(seconds: float | None) -> str:
    """``1d 02:03:04`` / ``2:03:04`` for a span of time; ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    days, rest = divmod(int(round(seconds)), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


MOE_IMBALANCE = "moe/load_imbalance_max"
AUX_LOSS = "aux_loss"


def format_line(record: Mapping[str, Any], total_steps: int, color: bool = False) -> str:
    """The one console line of a logged step; with `color`, each field in its ANSI colour (for a terminal)."""
    mfu = record["mfu"]
    fields = (
        f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
        f"loss {_number(record.get('loss'), '.4f')}",
        # A family's auxiliary loss (MoE load balancing), apart from the cross-entropy `loss`.
        *([f"aux_loss {record[AUX_LOSS]:.4g}"] if AUX_LOSS in record else []),
        f"grad_norm {_number(record.get('grad_norm'), '.3f')}",
        f"lr {_number(record.get('lr'), '.2e')}",
        f"tps {_number(record['tps'], ',.0f')}",
        f"tflops {_number(record['tflops'], '.2f')}",
        f"mfu {'-' if mfu is None else f'{mfu:.2f}%'}",
        f"mem {record['memory_gib']:.2f}GiB",
        f"eta {format_duration(record['eta_s'])}",
        # MoE models: the busiest expert's load over the mean, in the worst layer (per layer in the files).
        *([f"moe_imbalance {record[MOE_IMBALANCE]:.2f}"] if MOE_IMBALANCE in record else []),
    )
    return "  ".join(colored(text.split(" ", 1)[0], text) if color else text for text in fields)


class MetricsLogger:
    """Logs the training metrics every ``metrics.log_freq`` steps: console, metrics.jsonl, TensorBoard, W&B.

    Rank 0 writes ``<dump_folder>/metrics.jsonl`` and TensorBoard events under ``<dump_folder>/<save_tb_folder>/``;
    other ranks write nothing. With ``metrics.save_for_all_ranks`` every rank r writes ``metrics_rank<r>.jsonl``
    and ``<save_tb_folder>/rank_<r>/`` instead. With ``metrics.enable_wandb`` the same ranks also log to a Weights &
    Biases run created with ``run_config`` (the resolved config as a dict). Every rank computes the same record, so
    the loop calls ``log`` on all ranks; it runs no collectives. ``cfg`` is the ``[metrics]`` section and
    ``total_steps`` is ``training.steps`` (the last step is always logged, and the ETA counts down to it). The
    console line is coloured when the console is a terminal, unless ``metrics.disable_color_printing``.

    Usage in the loop::

        metrics_logger = MetricsLogger(cfg.metrics, run_dir, total_steps, rank, world_size, num_flops_per_token,
                                       device, torch.bfloat16)
        metrics_logger.start(state.step, state.tokens_seen)   # after any resume; starts the clock
        for step in range(state.step + 1, total_steps + 1):
            metrics = train_step(state, batch)
            tokens += global_tokens_of_this_step
            if metrics_logger.should_log(step):
                metrics_logger.log(step, metrics, tokens)
                tokens = 0
        metrics_logger.close()
    """

    def __init__(
        self,
        cfg: Metrics,
        dump_folder: str | os.PathLike,
        total_steps: int,
        rank: int,
        world_size: int,
        num_flops_per_token: float,
        device: torch.device,
        dtype: torch.dtype,
        *,
        run_config: Mapping[str, Any] | None = None,
    ):
        self.log_freq = cfg.log_freq
        self.total_steps = total_steps
        self.world_size = world_size
        self.num_flops_per_token = num_flops_per_token
        self.device = device
        self.peak_flops = device_peak_flops(device, dtype)
        self._jsonl: JsonlWriter | None = None
        self._tensorboard: TensorBoardWriter | None = None
        self._wandb: WandbWriter | None = None
        self._color = not cfg.disable_color_printing
        if rank == 0 or cfg.save_for_all_ranks:
            dump_folder = Path(dump_folder)
            per_rank = cfg.save_for_all_ranks
            self._jsonl = JsonlWriter(dump_folder / (f"metrics_rank{rank}.jsonl" if per_rank else "metrics.jsonl"))
            if cfg.enable_tensorboard:
                tb_folder = dump_folder / cfg.save_tb_folder
                self._tensorboard = TensorBoardWriter(tb_folder / f"rank_{rank}" if per_rank else tb_folder)
            if cfg.enable_wandb:
                self._wandb = WandbWriter(dump_folder, run_config or {}, rank if per_rank else None)
        self._log_peak(device, dtype)
        self.start()

    def _log_peak(self, device: torch.device, dtype: torch.dtype) -> None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        if self.peak_flops is None:
            logger.info(f"MFU not reported: no known dense peak FLOP/s for {name} computing in {dtype}")
        else:
            logger.info(f"MFU against {self.peak_flops / 1e12:.1f} TFLOP/s ({name}, {dtype}); tps is per rank")

    def start(self, step: int = 0, tokens_seen: int = 0) -> None:
        """Start the clock at ``step`` with ``tokens_seen`` tokens already trained on (non-zero after a resume).

        The constructor starts at step 0; call this again right before the first train step to leave setup time
        (model build, checkpoint load) out of the first window, or to continue the counts of a resumed run.
        """
        now = time.perf_counter()
        self._start_time = now
        self._window_start_time = now
        self._window_start_step = step
        self._tokens_seen = tokens_seen
        # The first window after a start holds the first step, which compiles (minutes, with torch.compile) and
        # warms the allocator: extrapolated over the run it would give a wild ETA, so that window shows none.
        self._first_window = True

    def should_log(self, step: int) -> bool:
        """Log the first step (to see the initial loss at once), every log_freq-th step, and the last step."""
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def log(
        self, step: int, metrics: Mapping[str, torch.Tensor | float | int], tokens_since_last: int | None,
        tokens_seen: int | None = None,
    ) -> dict[str, Any]:
        """Read ``metrics``, compute throughput since the previous log, and write one record everywhere.

        ``metrics`` holds the train step's 0-dim tensors (or numbers), e.g. loss, grad_norm, lr; names other than
        those three are recorded in metrics.jsonl and TensorBoard but not printed (a mixture's ``loss/<source>``,
        ``tokens/<source>`` and ``tokens_seen/<source>`` have a console line of their own: source_metrics.py).
        ``tokens_since_last`` counts the tokens that *all ranks together* trained on since the previous log (global
        batch tokens x steps); None when the window's tokens are not this process's work (a replica group that
        took a live peer's state): no throughput then. ``tokens_seen`` replaces the running count (the state's).
        This waits for the device, so the timing covers all queued work. Returns the record written.
        """
        reserved = sorted(set(metrics) & set(COMPUTED_FIELDS))
        if reserved:
            raise ValueError(f"metric names {reserved} clash with fields the metrics logger computes")
        steps_in_window = step - self._window_start_step
        if steps_in_window <= 0:
            raise ValueError(f"log step {step} must come after the previous one ({self._window_start_step})")
        synchronize_device(self.device)
        values = read_metric_values(metrics)
        now = time.perf_counter()
        window_s = max(now - self._window_start_time, 1e-9)
        self._tokens_seen = self._tokens_seen + (tokens_since_last or 0) if tokens_seen is None else tokens_seen
        tps = None if tokens_since_last is None else tokens_since_last / window_s / self.world_size
        flops_per_s = None if tps is None else tps * self.num_flops_per_token
        shown = {name: values.pop(name, None) for name in LINE_METRICS}
        sources = source_fields(values)  # a dataset mixture's loss and tokens by source (source_metrics.py)
        record: dict[str, Any] = {
            "step": step,
            **shown,
            "tps": tps,
            "tflops": None if flops_per_s is None else flops_per_s / 1e12,
            "mfu": 100 * flops_per_s / self.peak_flops if self.peak_flops and flops_per_s is not None else None,
            "memory_gib": peak_memory_gib(self.device),
            "elapsed_s": now - self._start_time,
            "eta_s": None if self._first_window else window_s / steps_in_window * max(self.total_steps - step, 0),
            "tokens_seen": self._tokens_seen,
            **sources,
            **values,
        }
        self._window_start_time, self._window_start_step = now, step
        self._first_window = False
        logger.info(format_line(record, self.total_steps, color=self._color and console_is_terminal(logger)))
        sources_line = format_sources_line(record)
        if sources_line is not None:
            logger.info(sources_line)
        self._write_sinks(step, record)
        return record

    def log_validation(self, step: int, values: Mapping[str, float], seconds: float = 0.0) -> dict[str, Any]:
        """Write one validation record, ``{"step": step, **values}`` (val_loss, val_perplexity): a console line,
        a metrics.jsonl record of its own, and TensorBoard scalars (W&B too) of those names at ``step``.

        ``seconds``, the evaluation's wall time, is left out of the throughput window it fell in.
        """
        self._window_start_time += seconds
        record = {"step": step, **values}
        shown = "  ".join(f"{name} {value:.4f}" for name, value in values.items())
        logger.info(f"validation  step {step:>{len(str(self.total_steps))}}/{self.total_steps}  {shown}")
        self._write_sinks(step, record)
        return record

    def _write_sinks(self, step: int, record: dict[str, Any]) -> None:
        """Write `record` to every file and service this rank logs to (all but the console)."""
        if self._jsonl is not None:
            self._jsonl.write(record)
        for sink in (self._tensorboard, self._wandb):
            if sink is not None:
                sink.write(step, record)

    def close(self) -> None:
        """Flush and close the metrics files (safe to call more than once)."""
        for sink in (self._jsonl, self._tensorboard, self._wandb):
            if sink is not None:
                sink.close()
        self._jsonl = self._tensorboard = self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
