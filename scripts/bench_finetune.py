"""Fine-tuning memory and speed: full fine-tuning, LoRA and QLoRA on the same model, side by side in one table.

    python scripts/bench_finetune.py                     # Llama 3 shape, dim 512, 4 layers, on this CPU
    python scripts/bench_finetune.py --dim 256 --layers 2 --steps 4 --json finetune.json

Each mode runs in a fresh process of its own (so that one mode's peak memory is not another's), on the same model
(same seeded init, same batches) with the trainer's pieces: the model built on the meta device, LoRA's transform
(``lora.target_modules = all-linear``, rank 16), ``to_empty`` and the seeded init, QLoRA's NF4 quantization of the
base weights (precision/qlora.py), and the trainer's AdamW (``build_optimizers``). After the steps it measures from
the live state what each part of it holds: parameters (an NF4 weight at its codes' and scales' bytes), gradients
(the ``.grad`` tensors) and optimizer state, in bytes per parameter of the model; the process's peak resident
memory (``ru_maxrss``), also above what it held before building the model (torch's own libraries), and its resident
memory after the steps (QLoRA's peak includes the base in float32 before it is quantized; after the steps only the
NF4 form is left); and the median step time as a ratio to full fine-tuning, in CPU time (the process's, one
thread by default: the work done, which a shared machine's load leaves alone) and in wall time. Everything is
float32 (the CPU's compute dtype here); on a GPU the base would sit in bf16 for LoRA, which halves its row's
parameter bytes but leaves QLoRA's.
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

MODES = ("full", "lora", "qlora")
MIB = 2**20


@dataclass
class Result:
    mode: str
    params: int  # parameters of the model (the base's count, adapters apart)
    trainable: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    peak_rss: int  # bytes, the whole process
    peak_rss_above_start: int  # bytes above the process's resident memory before the model was built
    end_rss: int  # bytes resident after the steps: the steady state (a QLoRA base's float form is gone by then)
    step_s: float  # median wall time of a step
    step_cpu_s: float  # median CPU time of a step (this process's threads), what a shared machine's load leaves alone
    losses: list[float]


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _resident_bytes() -> int:
    """The process's resident memory now (Linux's /proc; large freed blocks go back to the system)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def build(mode: str, opts):
    """The model of `mode` as the trainer builds it (module doc) and the trainer's AdamW for it."""
    from dtrain.config.schema import LoRA, Optimizer
    from dtrain.models.llama3 import Llama3Args
    from dtrain.parallelize import get_family
    from dtrain.precision.lora import apply_lora, init_lora_weights
    from dtrain.precision.qlora import check_nf4_shapes, quantize_base_weights
    from dtrain.step.optimizer import build_optimizers

    args = Llama3Args(
        dim=opts.dim, n_layers=opts.layers, n_heads=opts.dim // 64, n_kv_heads=opts.dim // 128,
        vocab_size=opts.vocab, multiple_of=256, ffn_dim_multiplier=None, max_seq_len=opts.seq_len,
    )
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(args)
    if mode != "full":
        lora = LoRA(enable=True, rank=opts.rank, alpha=2.0 * opts.rank, target_modules=["all-linear"],
                    quantize_base=mode == "qlora")
        apply_lora(model, lora)
        if lora.quantize_base:
            check_nf4_shapes(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    if mode != "full":
        init_lora_weights(model, seed=0)
    if mode == "qlora":
        quantize_base_weights([model])
    model.train()
    return model, build_optimizers([model], Optimizer(name="AdamW", lr=1e-4), torch.device("cpu"))


def batches(opts) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, opts.vocab, (opts.batch, opts.seq_len + 1), generator=generator)
            for _ in range(opts.steps)]


def step(model, optimizer, tokens: torch.Tensor) -> tuple[float, int]:
    """One training step on `tokens`: (loss, bytes of the gradients it made)."""
    from dtrain.parallelize.memory import stored_bytes

    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    grad_bytes = sum(stored_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), grad_bytes


def measure_memory(mode: str, opts) -> Result:
    """Build `mode`'s model in this (fresh) process, train `opts.steps` steps and measure its state (module doc)."""
    from dtrain.parallelize.memory import stored_bytes

    torch.set_num_threads(opts.threads)
    start_rss = _rss_bytes()
    model, optimizer = build(mode, opts)
    losses, wall, cpu = [], [], []
    for tokens in batches(opts):
        begin, begin_cpu = time.perf_counter(), time.process_time()
        loss, grad_bytes = step(model, optimizer, tokens)
        wall.append(time.perf_counter() - begin)
        cpu.append(time.process_time() - begin_cpu)
        losses.append(loss)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    peak = _rss_bytes()
    return Result(
        mode=mode,
        params=sum(p.numel() for name, p in model.named_parameters() if ".lora_" not in name),
        trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
        param_bytes=sum(stored_bytes(p) for p in model.parameters()),
        grad_bytes=grad_bytes,
        optimizer_bytes=sum(stored_bytes(t) for t in state),
        peak_rss=peak,
        peak_rss_above_start=peak - start_rss,
        end_rss=_resident_bytes(),
        step_s=statistics.median(wall[opts.warmup:]),
        step_cpu_s=statistics.median(cpu[opts.warmup:]),
        losses=losses,
    )


def table(results: list[Result]) -> str:
    full = next(r for r in results if r.mode == "full")
    rows = [
        "| mode | trainable params | params B/param | grads B/param | optimizer B/param | state B/param | "
        "peak RSS (MiB) | above start (MiB) | RSS after (MiB) | step CPU time | step wall time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        per = [b / r.params for b in (r.param_bytes, r.grad_bytes, r.optimizer_bytes)]
        rows.append(
            f"| {r.mode} | {r.trainable:,} ({100 * r.trainable / r.params:.2f}%) | {per[0]:.3f} | {per[1]:.3f} | "
            f"{per[2]:.3f} | {sum(per):.3f} | {r.peak_rss / MIB:.0f} | {r.peak_rss_above_start / MIB:.0f} | "
            f"{r.end_rss / MIB:.0f} | "
            f"{r.step_cpu_s / full.step_cpu_s:.2f}x ({r.step_cpu_s * 1e3:.0f} ms) | "
            f"{r.step_s / full.step_s:.2f}x ({r.step_s * 1e3:.0f} ms) |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the step time")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each mode's process")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a mode's own process
    opts = parser.parse_args()
    if opts.steps <= opts.warmup:
        parser.error(f"--steps ({opts.steps}) must exceed --warmup ({opts.warmup})")
    if opts.one:
        print(json.dumps(asdict(measure_memory(opts.one, opts))))
        return
    modes = opts.modes.split(",")
    if "full" not in modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: a comma-separated subset of {', '.join(MODES)} that includes full (the ratios' base)")
    shape = ("dim", "layers", "vocab", "rank", "batch", "seq_len", "steps", "warmup", "threads")
    passed = [arg for key in shape for arg in (f"--{key}", str(getattr(opts, key)))]
    results = []
    for mode in modes:
        done = subprocess.run([sys.executable, __file__, *passed, "--one", mode], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{mode}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        results.append(Result(**json.loads(done.stdout.strip().splitlines()[-1])))
    print(table(results))
    if opts.json:
        with open(opts.json, "w") as file:
            json.dump([asdict(r) for r in results], file, indent=2)


if __name__ == "__main__":
    main()
