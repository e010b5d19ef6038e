import math

import pytest
import torch

from dtrain.config.schema import LRScheduler
from dtrain.lr_schedule import build_lr_scheduler, lr_factor


def factors(total, **kw):
    cfg = LRScheduler(**kw)
    return [lr_factor(s, total, cfg) for s in range(total)]


def test_warmup_rises_linearly_to_peak_then_linear_decay_to_min():
    f = factors(10, warmup_steps=4, decay_type="linear", min_lr_factor=0.0)
    assert f[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    assert f[4] < 1.0 and f[-1] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(f[4:], f[5:]))


def test_wsd_keeps_peak_until_decay_phase():
    f = factors(20, warmup_steps=2, decay_ratio=0.25, decay_type="linear", min_lr_factor=0.1)
    assert f[2:15] == pytest.approx([1.0] * 13)
    assert f[15] < 1.0 and f[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("kind", ["linear", "sqrt", "cosine"])
def test_decay_shapes_end_at_min_and_differ(kind):
    f = factors(10, warmup_steps=0, decay_type=kind, min_lr_factor=0.2)
    assert f[-1] == pytest.approx(0.2)
    mid = f[4]  # progress (4 + 1) / 10
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
    assert seen == pytest.approx([1 / 5, 2 / 5, 3 / 5])


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
