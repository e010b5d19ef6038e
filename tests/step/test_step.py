"""The functional step: accumulation equivalence, determinism, and what it returns."""

import pytest
import torch

from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.step.executor import LocalExecutor
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import StepSetup, TrainState
from dtrain.step.train_step import StepLoss, cross_entropy_sum, train_step

ARGS = Llama3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


class NoData:
    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def make_state(seed=0, max_norm=1.0):
    torch.manual_seed(seed)
    model = Transformer(ARGS)
    model.init_weights()
    opt = build_optimizers([model], Optimizer(lr=1e-2), torch.device("cpu"))
    sched = build_lr_scheduler(opt, 100, LRScheduler(warmup_steps=2))
    return TrainState([model], opt, sched, NoData(), StepSetup(LocalExecutor(StepLoss()), seed=seed, max_norm=max_norm))


def global_batch(step, n=8, seq=16):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, ARGS.vocab_size, (n, seq + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, :3] = IGNORE_INDEX  # uneven valid-token counts across microbatches
    return tokens[:, :-1], labels


def split(step, microbatches):
    inputs, labels = global_batch(step)
    size = inputs.shape[0] // microbatches
    return [
        {"input_ids": inputs[i * size : (i + 1) * size], "labels": labels[i * size : (i + 1) * size]}
        for i in range(microbatches)
    ]


def run(microbatches, steps=4, same_batch=False):
    state = make_state()
    losses = [train_step(state, split(0 if same_batch else s, microbatches)) for s in range(steps)]
    return [m["loss"].item() for m in losses], state


# Parameters after 4 steps of 1x8 and 4x2 differ by fp32 rounding only, but AdamW divides each gradient element by
# its own running magnitude, so an element whose gradient nearly cancels turns the summation-order rounding into
# update differences of up to ~4e-6 (seen with both torch 2.11's and 2.13's initialisations). The bound is 1e-3
# of the peak learning rate; a wrongly scaled microbatch moves parameters by the order of the learning rate. The
# float64 test below shows the accumulation math itself is exact.
PARAM_ATOL_FP32 = 1e-3 * 1e-2


def test_accumulation_equivalence_1x8_equals_4x2():
    whole, state_a = run(1)
    accumulated, state_b = run(4)
    assert whole == pytest.approx(accumulated, rel=1e-5)
    for pa, pb in zip(state_a.parameters, state_b.parameters):
        torch.testing.assert_close(pa, pb, rtol=0, atol=PARAM_ATOL_FP32)


def test_accumulation_is_exact_in_float64():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, state_a = run(1)
        _, state_b = run(4)
    finally:
        torch.set_default_dtype(default)
    assert state_a.parameters[0].dtype == torch.float64
    assert max((pa - pb).abs().max().item() for pa, pb in zip(state_a.parameters, state_b.parameters)) < 1e-12


def test_loss_is_global_token_mean():
    state = make_state()
    mbs = split(0, 2)
    with torch.no_grad():
        model = state.model_parts[0]
        total = sum(cross_entropy_sum(model(mb["input_ids"]), mb["labels"]) for mb in mbs)
        count = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in mbs)
    metrics = train_step(state, mbs)
    assert metrics["loss"].item() == pytest.approx((total / count).item(), rel=1e-6)


def test_same_seed_bit_identical_and_loss_falls():
    a, _ = run(2, steps=6, same_batch=True)
    b, _ = run(2, steps=6, same_batch=True)
    assert a == b
    assert a[-1] < a[0]


def test_step_advances_state_and_reports_tensors():
    state = make_state(max_norm=1e-3)
    metrics = train_step(state, split(0, 2))
    assert state.step == 1 and state.tokens_seen == 8 * 16
    assert isinstance(metrics["loss"], torch.Tensor) and metrics["loss"].ndim == 0
    assert metrics["grad_norm"].item() > 1e-3  # the norm before clipping is reported
    assert metrics["lr"] == pytest.approx(1e-2 / 2)  # step 1 of a 2-step warmup (torchtitan's 1/warmup_steps)
    assert all(p.grad is None for p in state.parameters)  # zeroed for the next step


def test_deterministic_warn_only_warns_instead_of_raising():
    from dtrain.step.rng import set_determinism

    try:
        set_determinism(True, warn_only=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
