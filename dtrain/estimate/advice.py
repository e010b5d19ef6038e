"""When a layout does not fit: the changes that would make it fit, each re-estimated.

A change is the `--section.key VALUE` flags a user appends to the same command; each is estimated by loading the
command's own flags plus the change's, so its figure is that config's estimate, not a scaled guess. Which changes
are tried, how they combine and their order: docs/planning.md, "When it does not fit: the changes that would".
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.config import load_config
from dtrain.config.schema import JobConfig
from dtrain.errors import DtrainError
from dtrain.estimate.estimator import Estimate, estimate
from dtrain.estimate.hardware import Hardware
from dtrain.run.layout import parallel_dims

DEGREES = (2, 4, 8)
# How far the estimated step time shows a change's cost: fully, not its numerics, not its time.
COST_IN_STEP_TIME, COST_IN_NUMERICS, COST_NOT_MODELLED = 0, 1, 2
# Changes combined at most when no single one fits.
MAX_COMBINED = 3


@dataclass(frozen=True)
class Change:
    settings: tuple[tuple[str, str], ...]  # (section.key, value) pairs; "" for a boolean switched on
    what: str  # what it trades, in a few words
    cost: int = COST_IN_STEP_TIME
    # Changes of one ladder (a degree raised, a microbatch lowered) save more memory and cost more time at each
    # rung: once one fits, the higher rungs are not estimated.
    ladder: str = ""

    @property
    def flags(self) -> list[str]:
        """The arguments to append to the command."""
        return [arg for key, value in self.settings for arg in (f"--{key}", value) if arg]

    def combined(self, other: Change) -> Change | None:
        """Both changes together, or None where they set one key to different values."""
        merged = dict(self.settings)
        for key, value in other.settings:
            if merged.setdefault(key, value) != value:
                return None
        return Change(tuple(merged.items()), f"{self.what}; {other.what}", max(self.cost, other.cost))


@dataclass(frozen=True)
class Suggestion:
    change: Change
    estimate: Estimate

    @property
    def total_bytes(self) -> int:
        return self.estimate.busiest.memory.total

    @property
    def order(self) -> tuple:
        return self.change.cost, self.estimate.step_time_s, self.total_bytes, self.change.flags

    def to_json(self) -> dict:
        e = self.estimate
        return {"flags": self.change.flags, "what": self.change.what, "total_bytes": self.total_bytes,
                "fits": e.fits, "step_time_s": e.step_time_s, "tokens_per_s_per_device": e.tokens_per_s_per_device}


@dataclass(frozen=True)
class Advice:
    tried: int  # valid configs estimated
    fitting: list[Suggestion]  # fastest first
    closest: Suggestion | None  # when none fits: the one with the least memory per rank

    def to_json(self) -> dict:
        return {"tried": self.tried, "suggestions": [s.to_json() for s in self.fitting],
                "closest": self.closest.to_json() if self.closest else None}


def _current(cfg: JobConfig, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _change(cfg: JobConfig, what: str, settings: list[tuple[str, object]], cost: int = COST_IN_STEP_TIME,
            ladder: str = "") -> Change | None:
    """The settings that differ from `cfg`'s as a change, or None when none does."""
    pairs = []
    for key, value in settings:
        if _current(cfg, key) != value:
            pairs.append((key, "" if value is True else str(value)))
    return Change(tuple(pairs), what, cost, ladder) if pairs else None


def candidate_changes(cfg: JobConfig, world_size: int, hardware: Hardware) -> list[Change]:
    """Every single change worth estimating for `cfg` on `world_size` devices of `hardware` (the module doc)."""
    dims = parallel_dims(cfg.parallelism, world_size)
    t, p, ac = cfg.training, cfg.parallelism, cfg.activation_checkpoint
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_size
    keep_batch = ("training.global_batch_size", global_batch)
    rest_fsdp = ("parallelism.data_parallel_shard_degree", -1)

    def with_degrees(tp: int, cp: int) -> list[tuple[str, object]] | None:
        """tp and cp as given, FSDP over the ranks left, the same global batch: each data-parallel rank's share
        in microbatches of the largest size that divides it, at most the configured one (None: it cannot)."""
        dp = world_size // (tp * cp * dims.pp)
        if world_size % (tp * cp * dims.pp) or global_batch % dp:
            return None
        share = global_batch // dp
        local = max(b for b in range(1, min(share, t.local_batch_size) + 1) if share % b == 0)
        return [("parallelism.tensor_parallel_degree", tp), ("parallelism.context_parallel_degree", cp), rest_fsdp,
                ("training.local_batch_size", local), keep_batch]

    found: list[Change | None] = []
    recompute = {"op": "selective AC by op: all but matmuls and attention recomputed",
                 "2": "selective AC: every 2nd block recomputed",
                 "": "full AC: every block's forward recomputed (+1/3 compute)"}
    for mode, option in (("selective", "op"), ("selective", "2"), ("full", "")):
        settings = [("activation_checkpoint.mode", mode)]
        if option:
            settings.append(("activation_checkpoint.selective_ac_option", option))
        if ac.mode != "full" and (ac.mode != mode or (option and ac.selective_ac_option != option)):
            found.append(_change(cfg, recompute[option], settings))
    b = t.local_batch_size // 2
    while b >= 1:
        steps = global_batch // (b * dims.dp_size)
        found.append(_change(cfg, f"microbatches of {b}, {steps} accumulation steps (same global batch)",
                             [("training.local_batch_size", b), keep_batch], ladder="microbatch"))
        b //= 2
    if dims.pp > 1:
        m = p.pipeline_parallel_microbatch_size // 2
        while m >= 1:
            found.append(_change(cfg, f"pipeline microbatches of {m}",
                                 [("parallelism.pipeline_parallel_microbatch_size", m)], ladder="pp microbatch"))
            m //= 2
    if dims.dp_replicate > 1:
        found.append(_change(cfg, "FSDP over the replicas too", [("parallelism.data_parallel_replicate_degree", 1),
                                                                  rest_fsdp, keep_batch]))
    if p.fsdp_reshard_after_forward == "never":
        found.append(_change(cfg, "FSDP frees gathered parameters after forward (gathers them again in backward)",
                             [("parallelism.fsdp_reshard_after_forward", "default")]))
    for tp in DEGREES:
        if dims.tp < tp <= hardware.gpus_per_node and (settings := with_degrees(tp, dims.cp)):
            found.append(_change(cfg, f"tensor parallel {tp} within a node, FSDP over the rest", settings, ladder="tp"))
    for cp in DEGREES:
        if cp > dims.cp and (settings := with_degrees(dims.tp, cp)):
            found.append(_change(cfg, f"context parallel {cp}: each sequence split over {cp} ranks", settings,
                                 ladder="cp"))
    for pp in DEGREES:
        dp = world_size // (pp * dims.tp * dims.cp)  # replicas and shards
        if pp > dims.pp and world_size % (pp * dims.tp * dims.cp) == 0 and global_batch % dp == 0:
            per_rank = global_batch // dp
            found.append(_change(cfg, f"{pp} pipeline stages, the rank's {per_rank} sequences as microbatches",
                                 [("parallelism.pipeline_parallel_degree", pp), rest_fsdp,
                                  ("training.local_batch_size", per_rank), keep_batch], ladder="pp"))
    if cfg.optimizer.name in ("AdamW", "Adam"):
        for bits in ("8bit", "4bit"):
            found.append(_change(cfg, f"Adam's moments in {bits[0]} bits (torchao)",
                                 [("optimizer.name", cfg.optimizer.name + bits)], COST_IN_NUMERICS))
    if hardware.name != "cpu" and not t.enable_cpu_offload:
        offload = [("training.enable_cpu_offload", True)]
        what = "FSDP keeps params, grads and optimizer state on the host (transfers not in the step time)"
        if not dims.fsdp_enabled and dims.tp > 1:  # offload is FSDP's: make room for it from TP
            offload += with_degrees(dims.tp // 2, dims.cp) or []
            what = f"tensor parallel {dims.tp // 2}, FSDP over the rest, which keeps params, grads and optimizer " \
                   "state on the host (transfers not in the step time)"
        found.append(_change(cfg, what, offload, COST_NOT_MODELLED))
    return [c for c in found if c is not None]


def _estimate_change(config_args: list[str], change: Change, world_size: int, hardware: Hardware, cache: dict
                     ) -> Suggestion | None:
    """The change re-estimated from the command's flags plus its own, or None where that config is refused."""
    try:
        cfg = load_config([*config_args, *change.flags])
        return Suggestion(change, estimate(cfg, world_size, hardware, cache))
    except DtrainError:
        return None


def changes_that_fit(config_args: list[str], world_size: int, hardware: Hardware, cache: dict | None = None) -> Advice:
    """The changes to the command `config_args` (the estimator's --section.key flags) that make it fit, each
    re-estimated; `cache` is the parts cache of the command's own estimate, if it had one."""
    cache = {} if cache is None else cache
    cfg = load_config(config_args)
    singles = candidate_changes(cfg, world_size, hardware)
    tried: list[Suggestion] = []
    fitted_ladders = set()
    for change in singles:
        if change.ladder in fitted_ladders:
            continue
        if suggestion := _estimate_change(config_args, change, world_size, hardware, cache):
            tried.append(suggestion)
            if suggestion.estimate.fits and change.ladder:
                fitted_ladders.add(change.ladder)
    count = len(tried)
    fitting = [s for s in tried if s.estimate.fits]
    closest = min(tried, key=lambda s: s.total_bytes, default=None)
    for _ in range(MAX_COMBINED - 1):
        if fitting or closest is None:
            break
        have = set(closest.change.settings)
        combos = [c for single in singles
                  if not set(single.settings) <= have and (c := closest.change.combined(single))]
        round_ = [s for c in combos if (s := _estimate_change(config_args, c, world_size, hardware, cache))]
        count += len(round_)
        fitting = [s for s in round_ if s.estimate.fits]
        better = min(round_, key=lambda s: s.total_bytes, default=None)
        if better is None or better.total_bytes >= closest.total_bytes:
            break
        closest = better
    fitting.sort(key=lambda s: s.order)
    return Advice(count, fitting, None if fitting else closest)


def format_changes(advice: Advice, hardware: Hardware, limit: int = 10) -> str:
    """The changes that fit, fastest first, each as the flags to append and its re-estimated figures."""
    def figures(s: Suggestion) -> str:
        e = s.estimate
        return (f"{s.total_bytes / 2**30:,.2f} GiB per rank, step {e.step_time_s:,.3f} s, "
                f"{e.tokens_per_s_per_device:,.0f} tokens/s/device: {s.change.what}")

    if advice.fitting:
        lines = [f"changes that make it fit ({len(advice.fitting)} of {advice.tried} tried, each re-estimated; append "
                 "the flags to the command), fastest first:"]
        for index, s in enumerate(advice.fitting[:limit], 1):
            lines += [f"{index:2d}. {' '.join(s.change.flags)}", f"    {figures(s)}"]
        if len(advice.fitting) > limit:
            lines.append(f"    and {len(advice.fitting) - limit} more (--json lists them all)")
        return "\n".join(lines)
    if advice.closest is None:
        return f"none of the {advice.tried} changes tried is a valid layout here"
    over = advice.closest.total_bytes - advice.closest.estimate.memory_budget_bytes
    return "\n".join([
        f"none of the {advice.tried} changes tried (alone or up to {MAX_COMBINED} together) fits "
        f"{hardware.memory_gib:.2f} GiB; the closest, still {over / 2**30:,.2f} GiB over:",
        f"    {' '.join(advice.closest.change.flags)}",
        f"    {figures(advice.closest)}",
    ])
