"""QLoRA (precision/qlora.py): NF4 base weights through torchao, their forward and gradients against LoRA on the
dequantized weights, the refusals, and their bytes in the memory estimate."""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from run_train_helpers import FP32, run_train  # noqa: E402

from dtrain.checkpoint import CheckpointManager, dcp_io
from dtrain.checkpoint.folders import read_record
from dtrain.checkpoint.hf_io import build_adapter, save_hf
from dtrain.checkpoint.peft_names import is_lora
from dtrain.config import load_config
from dtrain.config.schema import JobConfig, LoRA
from dtrain.config.validate import validate_config
from dtrain.data import build_dataloader, build_tokenizer
from dtrain.errors import ConfigError
from dtrain.estimate import estimate, load_hardware
from dtrain.models.llama3 import Llama3Args
from dtrain.parallelize import ParallelDims, ParallelizeOptions, get_family
from dtrain.precision.lora import apply_lora, init_lora_weights, lora_modules
from dtrain.parallelize.memory import memory_footprint, stored_bytes
from dtrain.precision.qlora import (
    NF4Tensor, VALUES_PER_SCALE_BLOCK, check_nf4_shapes, is_nf4, nf4_bytes, quantize_base_weights, to_nf4,
)
from dtrain.run.layout import ParallelLayout
from dtrain.run.memory_preflight import Workload, estimate_memory
from dtrain.step.executor import LocalExecutor
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import RankCoordinates, StepSetup, TrainState
from dtrain.step.train_step import StepLoss, train_step

# Every linear's weight holds a whole number of NF4 scale blocks (64 x 256 values): dim 256, FFN 768.
QLORA_ARGS = Llama3Args(
    dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=256, ffn_dim_multiplier=None,
    max_seq_len=16,
)
SETTINGS = LoRA(enable=True, rank=4, alpha=8.0, target_modules=["all-linear"], quantize_base=True)


def lora_model(args=QLORA_ARGS, settings=SETTINGS) -> torch.nn.Module:
    """A LoRA model on the CPU with seeded base weights and adapters whose lora_b is not zero (so they count)."""
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(args)
    apply_lora(model, settings)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    init_lora_weights(model, seed=0)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_b.weight.normal_(std=0.02)
    return model


def test_qlora_logits_and_adapter_grads_equal_lora_on_the_dequantized_base():
    qlora = lora_model()
    lora = copy.deepcopy(qlora)
    assert quantize_base_weights([qlora]) == len(lora_modules(qlora)) == 7 * QLORA_ARGS.n_layers
    with torch.no_grad():
        for fqn, module in lora_modules(lora).items():
            # torchao's own dequantization of the same quantization
            module.weight.copy_(to_nf4(module.weight).get_original_weight())
    for fqn, module in lora_modules(qlora).items():
        assert isinstance(module.weight, NF4Tensor) and not module.weight.requires_grad, fqn
    # The memory line (memory_footprint) counts the bases at NF4's bytes.
    bases = [m.weight.numel() for m in lora_modules(lora).values()]
    saved = memory_footprint(lora).param_bytes - memory_footprint(qlora).param_bytes
    assert saved == sum(4 * n - nf4_bytes(n) for n in bases)
    tokens = torch.randint(0, QLORA_ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    logits_q, logits_l = qlora(tokens), lora(tokens)
    assert torch.allclose(logits_q, logits_l, rtol=1e-6, atol=1e-6)
    logits_q.square().mean().backward()
    logits_l.square().mean().backward()
    grads = {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in name for name in grads)
    for name, param in qlora.named_parameters():
        if param.requires_grad:
            assert torch.allclose(param.grad, grads[name], rtol=1e-5, atol=1e-7), name
    # The quantization is not the identity: the base really is 4-bit.
    wq = lora_modules(qlora)["layers.0.attention.wq"]
    assert not torch.equal(wq.weight.get_original_weight(), lora_modules(lora_model())["layers.0.attention.wq"].weight)


def test_nf4_bytes_are_what_torchao_stores():
    weight = torch.randn(768, 256)
    nf4 = to_nf4(weight)
    assert stored_bytes(nf4) == nf4_bytes(weight.numel())
    assert 0.5 < nf4_bytes(weight.numel()) / weight.numel() < 0.52
    assert stored_bytes(weight) == 4 * weight.numel() and is_nf4(nf4) and not is_nf4(weight)


def test_shapes_nf4_cannot_store_or_shard_are_refused():
    small = replace(QLORA_ARGS, dim=64, multiple_of=32)
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(small)
    apply_lora(model, SETTINGS)
    with pytest.raises(ConfigError, match=rf"layers.0.attention.wq.weight \[64, 64\] has 4096 values, not a "
                                          rf"multiple of {VALUES_PER_SCALE_BLOCK}"):
        check_nf4_shapes(model)
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(QLORA_ARGS)
    apply_lora(model, SETTINGS)
    check_nf4_shapes(model, shards=2)  # every weight's rows and scale blocks divide by 2
    with pytest.raises(ConfigError, match=r"wk.weight \[128, 256\] cannot be split among 4 FSDP shards as NF4 "
                                          r"\(128 rows and 2 scale blocks"):
        check_nf4_shapes(model, shards=4)


def _config(**parallelism) -> JobConfig:
    cfg = JobConfig()
    cfg.lora = replace(SETTINGS)
    cfg.checkpoint.initial_load_path = "/some/base"
    for key, value in parallelism.items():
        setattr(cfg.parallelism, key, value)
    return cfg


@pytest.mark.parametrize("key, error", [
    ("no_base", "lora.quantize_base quantizes a base model: set checkpoint.initial_load_path"),
    ("no_lora", "lora.quantize_base needs lora.enable = true"),
    ("tensor_parallel_degree", "lora.quantize_base with parallelism.tensor_parallel_degree = 2 is not built"),
    ("pipeline_parallel_degree", "lora.quantize_base with parallelism.pipeline_parallel_degree = 2 is not built"),
    ("data_parallel_replicate_degree", "parallelism.data_parallel_replicate_degree = 2 is not built"),
    ("last_save_in_hf", "checkpoint.last_save_in_hf with lora.quantize_base is not built"),
])
def test_config_refuses_what_qlora_does_not_build(key, error):
    cfg = _config()
    if key == "no_base":
        cfg.checkpoint.initial_load_path = ""
    elif key == "no_lora":
        cfg.lora.enable = False
    elif key == "last_save_in_hf":
        cfg.checkpoint.enable = cfg.checkpoint.last_save_in_hf = cfg.checkpoint.last_save_model_only = True
    else:
        setattr(cfg.parallelism, key, 2)
    with pytest.raises(ConfigError, match=error):
        validate_config(cfg)


def test_memory_estimate_counts_nf4_base_weights_without_grads_or_moments():
    with torch.device("meta"):
        model = get_family("llama3").model.model_cls(QLORA_ARGS)
    apply_lora(model, SETTINGS)
    layout = ParallelLayout(ParallelDims(1), ParallelizeOptions())
    cfg = JobConfig()
    lora_only = estimate_memory([model], QLORA_ARGS, layout, Workload.of(cfg.training, cfg.optimizer, layout), "cpu")
    qlora = estimate_memory(
        [model], QLORA_ARGS, layout, Workload.of(cfg.training, cfg.optimizer, layout, quantize_base=True), "cpu"
    )
    bases = [m.weight.numel() for m in lora_modules(model).values()]
    assert lora_only.params - qlora.params == sum(4 * n - nf4_bytes(n) for n in bases)
    assert (qlora.grads, qlora.optimizer) == (lora_only.grads, lora_only.optimizer)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert qlora.grads == 4 * adapters  # the frozen base has no gradient


def _run_config(run_dir, base) -> JobConfig:
    """A QLoRA run of QLORA_ARGS from the Hugging Face folder `base`, on synthetic data, saving every 2 steps."""
    cfg = JobConfig()
    cfg.job.dump_folder = str(run_dir)
    cfg.model.tokenizer = "byte"
    cfg.training.dataset = "synthetic"
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = 16, 2, 6
    cfg.optimizer.lr = 1e-2
    cfg.checkpoint.enable, cfg.checkpoint.interval = True, 2
    cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_in_hf = str(base), True
    cfg.checkpoint.initial_load_model_only = True
    cfg.lora = replace(SETTINGS)
    return cfg


def _start(cfg: JobConfig) -> tuple[TrainState, CheckpointManager]:
    """The run's state as the trainer builds it (float base, adapters' init), restored by its CheckpointManager,
    which loads the base and then quantizes it."""
    model = get_family("llama3").model.model_cls(QLORA_ARGS)
    apply_lora(model, cfg.lora)
    init_lora_weights(model, cfg.debug.seed)
    optimizer = build_optimizers([model], cfg.optimizer, torch.device("cpu"))
    state = TrainState(
        model_parts=[model], optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(optimizer, cfg.training.steps, cfg.lr_scheduler),
        dataloader=build_dataloader(cfg.training, build_tokenizer(cfg.model), 0, 1, seed=cfg.debug.seed),
        setup=StepSetup(LocalExecutor(StepLoss()), seed=cfg.debug.seed, max_norm=cfg.training.max_norm,
                        rank=RankCoordinates()),
    )
    manager = CheckpointManager(
        cfg.checkpoint, cfg.job.dump_folder, 0, 1, state, training=cfg.training, parallelism=cfg.parallelism,
        model=cfg.model, optimizer=cfg.optimizer, model_args=QLORA_ARGS, lora=cfg.lora,
    )
    manager.restore_at_startup()
    return state, manager


def _train(state: TrainState, manager: CheckpointManager, until: int) -> list[float]:
    losses = []
    while state.step < until:
        losses.append(train_step(state, [next(state.dataloader)])["loss"].item())
        manager.maybe_save(state.step, last=state.step == 6)
    return losses


def test_a_qlora_run_quantizes_its_loaded_base_and_resumes_exactly(tmp_path):
    torch.manual_seed(5)
    base_model = get_family("llama3").model.model_cls(QLORA_ARGS)
    weights = dict(base_model.state_dict())
    base = tmp_path / "base"
    save_hf(weights, base, build_adapter("llama3", QLORA_ARGS), torch.float32)

    state, manager = _start(_run_config(tmp_path / "whole", base))
    wq = lora_modules(state.model_parts[0])["layers.0.attention.wq"].weight
    # Quantized from the loaded base, not from the init it replaced.
    assert is_nf4(wq) and torch.equal(wq.get_original_weight(),
                                      to_nf4(weights["layers.0.attention.wq.weight"]).get_original_weight())
    whole = _train(state, manager, 6)
    manager.close()

    cfg = _run_config(tmp_path / "cut", base)
    state, manager = _start(cfg)
    first = _train(state, manager, 4)
    manager.close()
    step4 = tmp_path / "cut" / "checkpoint" / "step-4"
    stored = [key for key in dcp_io.read_tensor_shapes(step4) if key.startswith("model.")]
    assert stored and all(is_lora(key) for key in stored)  # the adapters; the base is a reference
    assert read_record(step4).lora["base"]["path"] == str(base.resolve())
    state, manager = _start(cfg)  # loads the base again, quantizes it again, then the adapters
    assert state.step == 4 and is_nf4(lora_modules(state.model_parts[0])["layers.0.attention.wq"].weight)
    rest = _train(state, manager, 6)
    manager.close()
    assert first + rest == whole


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_qlora_fsdp_run_holds_the_nf4_bytes_the_estimator_counts(tmp_path):
    """./run_train.sh end to end: QLoRA on a Hugging Face base of the debug model under FSDP2 over 2 processes, whose
    memory line (the live state) shows the NF4 bases at the bytes the estimator counts."""
    short = ["--training.steps", "1", "--training.seq_len", "64", "--training.local_batch_size", "2", *FP32]
    debug_model = estimate(load_config(short), 1, load_hardware("cpu")).model_args  # the shape the run resolves
    torch.manual_seed(0)
    base = tmp_path / "base"
    save_hf(get_family("llama3").model.model_cls(debug_model).state_dict(), base, build_adapter("llama3", debug_model),
            torch.float32)
    args = [*short, "--checkpoint.initial_load_path", str(base), "--checkpoint.initial_load_in_hf",
            "--lora.enable", "--lora.quantize_base", "--lora.target_modules", "all-linear"]
    result = run_train(*args, "--job.dump_folder", str(tmp_path / "qlora"), NPROC="2")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "QLoRA: 42 base weights stored as NF4 from their loaded values" in out
    logged = re.search(r"\[rank0\].*memory on this rank: params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer ([\d.]+)",
                       out)
    m = estimate(load_config(args), 2, load_hardware("cpu")).stages[0].memory
    assert tuple(float(x) for x in logged.groups()) == pytest.approx(
        (m.params / 2**20, m.grads / 2**20, m.optimizer / 2**20), abs=0.006
    )
