import math

import pytest
import torch

from dtrain.config.schema import LRScheduler
from dtrain.step.lr_schedule import build_lr_scheduler, lr_factor


def factors(total, **kw):
    """The factor of every step of a `total`-step run, and of the step after it (torchtitan's virtual step)."""
    cfg = LRScheduler(**kw)
    return [lr_factor(s, total, cfg) for s in range(total + 1)]


def test_warmup_reaches_the_peak_on_its_last_step_then_linear_decay_to_min_one_step_after_the_run():
    f = factors(10, warmup_steps=4, decay_type="linear", min_lr_factor=0.0)
    assert f[:5] == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1.0, 1.0])
    assert all(a > b for a, b in zip(f[4:], f[5:]))
    # The last step trained still learns: min_lr_factor is reached one step past the run.
    assert f[9] == pytest.approx(1 / 6) and f[10] == 0.0


def test_wsd_keeps_peak_until_decay_phase():
    f = factors(20, warmup_steps=2, decay_ratio=0.25, decay_type="linear", min_lr_factor=0.1)
    assert f[2:16] == pytest.approx([1.0] * 14)
    assert f[16] == pytest.approx(0.1 + 0.9 * 4 / 5) and f[19] == pytest.approx(0.1 + 0.9 / 5)
    assert f[20] == pytest.approx(0.1)


def test_warmup_zero_starts_at_the_peak_and_warmup_longer_than_the_schedule_is_cut_to_it():
    assert factors(5, warmup_steps=0)[:2] == pytest.approx([1.0, 0.8])
    assert factors(4, warmup_steps=10) == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1.0, 1.0])


def test_a_run_longer_than_the_schedule_holds_the_final_rate():
    cfg = LRScheduler(warmup_steps=1, min_lr_factor=0.1)
    assert [lr_factor(s, 5, cfg) for s in range(5, 9)] == pytest.approx([0.1] * 4)


@pytest.mark.parametrize("kind", ["linear", "sqrt", "cosine"])
def test_decay_shapes_end_at_min_and_differ(kind):
    f = factors(10, warmup_steps=0, decay_type=kind, min_lr_factor=0.2)
    assert f[-1] == pytest.approx(0.2) and f[0] == 1.0
    mid = f[5]  # progress 5 / 10
    expected = {"linear": 0.5, "sqrt": 1 - math.sqrt(0.5), "cosine": 0.5}[kind]
    assert mid == pytest.approx(0.2 + 0.8 * expected)


def test_scheduler_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = build_lr_scheduler(opt, 10, LRScheduler(warmup_steps=4))
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1 / 4, 2 / 4, 3 / 4])


def test_total_steps_decouples_the_schedule_from_the_run_length():
    # torchtitan's lr_scheduler.total_steps: a 4-step run follows the first 4 steps of a 10-step schedule.
    def lrs(training_steps, **kw):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.AdamW([p], lr=1.0)
        sched = build_lr_scheduler(opt, training_steps, LRScheduler(warmup_steps=2, **kw))
        seen = []
        for _ in range(training_steps):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return seen

    assert lrs(4, total_steps=10) == pytest.approx(lrs(10)[:4])
    assert lrs(4) != pytest.approx(lrs(10)[:4])
