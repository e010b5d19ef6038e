"""The microbatch rule (`scripts/estimate.py --advise microbatch`): which pipeline microbatch size is fastest.

With global batch B over d data-parallel ranks and p pipeline ranks, microbatches of b sequences make a step of
B/(d·b) microbatches per rank, and a GPipe/1F1B pipeline takes (B/(d·b) + p − 1) · (t_f(b) + t_b(b)) (Narayanan
et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"): a larger b
uses the device better (t_f + t_b grows slower than b) but leaves fewer microbatches to fill the pipeline. t_f and
t_b are measured here, on this device, for the first pipeline stage of the configured layout, whole (not tensor-
parallel), and the memory each b needs is the estimator's for that stage. The recommendation is the fastest b
whose memory fits the hardware profile's.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from dtrain.config.schema import JobConfig
from dtrain.errors import ConfigError
from dtrain.estimate.estimator import estimate, fake_world
from dtrain.estimate.hardware import Hardware
from dtrain.parallelize.pipeline_split import split_model
from dtrain.run.layout import build_layout, parallel_dims
from dtrain.run.prepare import model_family


@dataclass(frozen=True)
class Candidate:
    microbatch_size: int
    forward_s: float
    backward_s: float
    step_s: float  # the rule's (B/(d·b) + p − 1)(t_f + t_b)
    memory_bytes: int
    fits: bool


def candidate_sizes(per_rank_batch: int) -> list[int]:
    """Microbatch sizes that divide a data-parallel rank's share of the global batch."""
    return [b for b in range(1, per_rank_batch + 1) if per_rank_batch % b == 0]


def _time_stage(stage: torch.nn.Module, b: int, seq_len: int, vocab: int, device: torch.device, repeats: int
                ) -> tuple[float, float]:
    """Median forward and backward seconds of `stage` on b sequences (after one untimed pass)."""
    tokens = torch.randint(0, vocab, (b, seq_len), device=device)
    forwards, backwards = [], []
    for index in range(repeats + 1):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = stage(tokens)
        sync()
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        sync()
        end = time.perf_counter()
        stage.zero_grad(set_to_none=True)
        if index:
            forwards.append(middle - start)
            backwards.append(end - middle)
    return sorted(forwards)[len(forwards) // 2], sorted(backwards)[len(backwards) // 2]


def advise_microbatch(cfg: JobConfig, world_size: int, hardware: Hardware, device: torch.device,
                      repeats: int = 3) -> list[Candidate]:
    """Every candidate microbatch size with its measured times, the rule's step time and its memory; reads the
    whole config, as the estimate does."""
    dims = parallel_dims(cfg.parallelism, world_size)
    if dims.pp == 1:
        raise ConfigError(
            "--advise microbatch ranks pipeline microbatch sizes: set parallelism.pipeline_parallel_degree > 1"
        )
    t = cfg.training
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_size
    per_rank = global_batch // dims.dp_size
    family, _ = model_family(cfg)
    candidates = []
    for b in candidate_sizes(t.local_batch_size):
        trial = copy.deepcopy(cfg)
        trial.parallelism.pipeline_parallel_microbatch_size = b
        try:
            result = estimate(trial, world_size, hardware)
        except ConfigError:
            continue  # a size the schedule cannot run (too few microbatches for its stages)
        args = result.model_args
        with fake_world(0, world_size) as world:
            plan = build_layout(trial, world, family, args).plan
        with torch.device(device):
            model = family.model.model_cls(args)
        stage = split_model(model, plan, 0)[0].module.to(device)
        forward_s, backward_s = _time_stage(stage, b, t.seq_len, args.vocab_size, device, repeats)
        memory = result.stages[0].memory.total
        step = (per_rank / b + dims.pp - 1) * (forward_s + backward_s)
        candidates.append(Candidate(b, forward_s, backward_s, step, memory, memory <= hardware.memory_gib * 2**30))
    if not candidates:
        raise ConfigError(
            f"no microbatch size divides training.local_batch_size={t.local_batch_size} into enough microbatches "
            f"for parallelism.pipeline_parallel_schedule {cfg.parallelism.pipeline_parallel_schedule}"
        )
    return sorted(candidates, key=lambda c: (not c.fits, c.step_s))


def format_advice(candidates: list[Candidate], hardware: Hardware) -> str:
    lines = ["| microbatch | t_f (ms) | t_b (ms) | step by the rule (s) | memory (GiB) | fits |", "|---|---|---|---|---|---|"]
    for c in candidates:
        lines.append(f"| {c.microbatch_size} | {c.forward_s * 1e3:,.1f} | {c.backward_s * 1e3:,.1f} | {c.step_s:,.3f} "
                     f"| {c.memory_bytes / 2**30:,.2f} | {'yes' if c.fits else 'no'} |")
    best = next((c for c in candidates if c.fits), None)
    if best is None:
        lines.append(f"no microbatch size fits {hardware.memory_gib:.1f} GiB: lower the sequence length, add ranks or AC")
    else:
        lines.append(f"recommended: --parallelism.pipeline_parallel_microbatch_size {best.microbatch_size}")
    return "\n".join(lines)

