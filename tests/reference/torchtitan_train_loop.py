"""torchtitan 0.2.2's training, from its own components, in the order its Trainer calls them (one process, CPU).

    python torchtitan_train_loop.py OUT_DIR --job.config_file FILE [--section.key value ...] [--model.args.NAME V]

torchtitan's full Trainer does not start on a CPU (it calls `torch.cuda.set_device`), so this script does what
`Trainer.__init__` and `Trainer.train_step` do with a world of one: parse the job config with torchtitan's
ConfigManager, build the flavor's model on the meta device, materialise it and run its `init_weights`, build its
optimizers, LR schedulers and loss, then step: zero_grad, lr of the step, forward, summed cross-entropy divided by
the step's valid tokens, backward, torchtitan's `clip_grad_norm_`, optimizer step, scheduler step.

It writes OUT_DIR/seed (torchtitan's initialised weights as a model-only DCP checkpoint, as
`checkpoint.create_seed_checkpoint` would) and OUT_DIR/steps.jsonl (step, loss, grad_norm, lr, and the step's wall
time time_s, which scripts/bench_vs_torchtitan.py's CPU dry run reads). The batches are
dtrain's, built from the same command line by dtrain's own data loader: the data is an input of the comparison,
not part of it. What is compared is everything torchtitan computes from it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from torchtitan_moe_cpu import run_moe_in_float32_on_cpu
from triton_stub import install_triton_stub


def dtrain_batches(argv: list[str]):
    """dtrain's batches for the same command line."""
    from dtrain.config import load_config
    from dtrain.data import build_dataloader, build_tokenizer

    cfg = load_config(argv)
    loader = build_dataloader(cfg.training, build_tokenizer(cfg.model), 0, 1, seed=cfg.debug.seed)
    for batch in loader:
        extra = set(batch) - {"input_ids", "labels"}
        if extra:  # positions or document ids would change torchtitan's attention: not part of this comparison
            raise SystemExit(f"dtrain's batch carries {sorted(extra)}; this reference loop takes plain causal batches")
        yield batch


# dtrain's names of MoE fields that torchtitan spells otherwise (Qwen3 and DeepSeek-V3 alike).
TORCHTITAN_FIELDS = {
    "moe_num_experts": "moe_args.num_experts",
    "moe_top_k": "moe_args.top_k",
    "moe_hidden_dim": "moe_inter_dim",
}


def split_model_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """torchtitan's command line, and dtrain's `--model.args.NAME VALUE` flags (a shape change torchtitan's CLI does
    not have) as {NAME: VALUE}: they are set on torchtitan's flavor args, where the names are the same."""
    rest, shape = [], {}
    flags = iter(argv)
    for flag in flags:
        if flag.startswith("--model.args."):
            shape[flag.removeprefix("--model.args.")] = next(flags)
        else:
            rest.append(flag)
    return rest, shape


def set_shape(model_args, shape: dict[str, str]) -> None:
    """Set dtrain's `--model.args` values (split_model_args) on torchtitan's flavor args, in their types."""
    for name, value in shape.items():
        owner, field = model_args, TORCHTITAN_FIELDS.get(name, name)
        if "." in field:
            inner, field = field.split(".")
            owner = getattr(model_args, inner)
        setattr(owner, field, type(getattr(owner, field))(value))


def main(out: Path, argv: list[str]) -> None:
    install_triton_stub()
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as parallel_dims_module
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.protocols.train_spec import get_train_spec
    from torchtitan.tools.utils import set_default_dtype

    torchtitan_argv, shape = split_model_args(argv)
    job = ConfigManager().parse_args(torchtitan_argv)
    # A world of one, as torchrun gives the Trainer: torchtitan's MoE updates reduce over the process group.
    dist.init_process_group("gloo", store=dist.FileStore(str(out / "store"), 1), rank=0, world_size=1)
    # Its meshes are built for the device type it detects, CUDA when there is none; its own CPU unit tests set it.
    parallel_dims_module.device_type = "cpu"
    device = torch.device("cpu")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    dist_utils.set_determinism(dims, device, job.debug, distinct_seed_mesh_dims=["pp"])
    spec = get_train_spec(job.model.name)

    model_args = spec.model_args[job.model.flavor]
    set_shape(model_args, shape)
    model_args.update_from_config(job)
    run_moe_in_float32_on_cpu(model_args)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[job.training.dtype]
    with torch.device("meta"), set_default_dtype(dtype):
        model = spec.model_cls(model_args)
    # A world of one: parallelize_fn would only add activation checkpointing, which recomputes the same numbers.
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    dcp.save(model.state_dict(), checkpoint_id=str(out / "seed"), no_dist=True)

    loss_fn = spec.build_loss_fn(job, parallel_dims=dims)
    optimizers = spec.build_optimizers_fn([model], job.optimizer, dims)
    lr_schedulers = spec.build_lr_schedulers_fn(optimizers, job.lr_scheduler, job.training.steps)
    accumulation = max(job.training.global_batch_size, job.training.local_batch_size) // job.training.local_batch_size

    batches = dtrain_batches(argv)  # dtrain reads the same command line, --job.config_file included
    with (out / "steps.jsonl").open("w") as records:
        for step in range(1, job.training.steps + 1):
            start = time.perf_counter()  # the step's wall time, batches included, as torchtitan's tps counts it
            # Trainer.train_step
            optimizers.zero_grad()
            lr = lr_schedulers.schedulers[0].get_last_lr()[0]
            microbatches = [next(batches) for _ in range(accumulation)]
            global_valid_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in microbatches).float()
            losses = []
            for mb in microbatches:  # Trainer.forward_backward_step
                pred = model(mb["input_ids"])
                loss = loss_fn(pred, mb["labels"]) / global_valid_tokens
                del pred
                loss.backward()
                losses.append(loss.detach())
            grad_norm = dist_utils.clip_grad_norm_(
                [p for p in model.parameters()], job.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False
            )
            optimizers.step()
            lr_schedulers.step()
            record = {"step": step, "loss": torch.stack(losses).sum().item(), "grad_norm": grad_norm.item(), "lr": lr}
            record["time_s"] = time.perf_counter() - start
            records.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
