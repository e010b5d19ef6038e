import json
import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dtrain.metrics import logger as metrics_logger_module
from dtrain.metrics.logger import MetricsLogger, format_duration, read_metric_values

CPU = torch.device("cpu")
REQUIRED_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "elapsed_s", "eta_s",
                 "tokens_seen"}


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(metrics_logger_module.time, "perf_counter", fake)
    return fake


@pytest.fixture
def fake_peak(monkeypatch):
    monkeypatch.setattr(metrics_logger_module, "device_peak_flops", lambda device, dtype: 1e12)


def metrics_logger(cfg, *args, **kwargs) -> MetricsLogger:
    """The logger the trainer builds from `cfg`'s sections."""
    return MetricsLogger(cfg.metrics, cfg.job.dump_folder, cfg.training.steps, *args, **kwargs)


def step_metrics(loss=2.5, grad_norm=1.25, lr=3e-4):
    return {"loss": torch.tensor(loss), "grad_norm": torch.tensor(grad_norm), "lr": lr}


def ml_path(cfg, name="metrics.jsonl"):
    return Path(cfg.job.dump_folder) / name


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_throughput_tflops_mfu_and_eta_math(cfg, clock, fake_peak, dtrain_logger):
    with metrics_logger(cfg, rank=0, world_size=2, num_flops_per_token=1e6, device=CPU, dtype=torch.bfloat16) as ml:
        clock.now += 2.0
        record = ml.log(10, step_metrics(), tokens_since_last=8000)
    # 8000 tokens over 2 s on 2 ranks: 2000 tokens/s per rank; x 1e6 FLOPs/token = 2e9 FLOP/s = 0.002 TFLOP/s.
    assert record["tps"] == pytest.approx(2000)
    assert record["tflops"] == pytest.approx(0.002)
    assert record["mfu"] == pytest.approx(0.2)
    # The first window holds the first step (compilation, warm-up): no ETA from it.
    assert record["eta_s"] is None
    assert record["elapsed_s"] == pytest.approx(2.0)
    assert record["tokens_seen"] == 8000
    assert (record["loss"], record["grad_norm"], record["lr"]) == (2.5, 1.25, 3e-4)
    line = dtrain_logger.messages[-1]
    for piece in ("step  10/100", "loss 2.5000", "grad_norm 1.250", "lr 3.00e-04", "tps 2,000", "tflops 0.00",
                  "mfu 0.20%", "eta -"):
        assert piece in line


def test_eta_leaves_out_the_first_window(cfg, clock, fake_peak, dtrain_logger):
    """A first step that compiled for 200 s must not make a 100-step run of 0.2 s steps look 5 hours long."""
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.bfloat16) as ml:
        clock.now += 200.0
        first = ml.log(1, step_metrics(), 1000)
        clock.now += 1.8
        record = ml.log(10, step_metrics(), 9000)
    assert first["eta_s"] is None
    # 9 steps took 1.8 s: 0.2 s/step x 90 steps left.
    assert record["eta_s"] == pytest.approx(18.0)
    assert "eta 0:00:18" in dtrain_logger.messages[-1]


def test_second_window_measures_only_its_own_steps(cfg, clock, fake_peak):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.bfloat16) as ml:
        clock.now += 10.0
        ml.log(10, step_metrics(), 1000)
        clock.now += 1.0
        record = ml.log(20, step_metrics(), 3000)
    assert record["tps"] == pytest.approx(3000)
    assert record["eta_s"] == pytest.approx(0.1 * 80)
    assert record["elapsed_s"] == pytest.approx(11.0)
    assert record["tokens_seen"] == 4000


def test_unknown_device_reports_no_mfu(cfg, clock, dtrain_logger):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.bfloat16) as ml:
        clock.now += 1.0
        record = ml.log(1, step_metrics(), 100)
    assert record["mfu"] is None
    assert read_jsonl(ml_path(cfg))[0]["mfu"] is None
    assert "mfu -" in dtrain_logger.messages[-1]
    assert any("MFU not reported" in message for message in dtrain_logger.messages)


def test_jsonl_has_one_object_per_log_with_the_required_keys(cfg, clock):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.float32) as ml:
        for step in (1, 10, 20):
            clock.now += 1.0
            ml.log(step, {**step_metrics(loss=float(step)), "num_tokens": torch.tensor(512)}, 100)
    records = read_jsonl(ml_path(cfg))
    assert [r["step"] for r in records] == [1, 10, 20]
    assert [r["loss"] for r in records] == [1.0, 10.0, 20.0]
    for record in records:
        assert REQUIRED_KEYS <= record.keys()
        assert record["num_tokens"] == 512
        assert record["memory_gib"] > 0


def test_an_auxiliary_loss_is_logged_apart_from_the_loss(cfg, clock, dtrain_logger):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.float32) as ml:
        clock.now += 1.0
        ml.log(1, step_metrics(), 100)
        assert "aux_loss" not in dtrain_logger.messages[-1]
        clock.now += 1.0
        ml.log(2, {**step_metrics(), "aux_loss": torch.tensor(0.0125, dtype=torch.float64)}, 100)
    assert "loss 2.5000  aux_loss 0.0125  grad_norm" in dtrain_logger.messages[-1]
    assert [record.get("aux_loss") for record in read_jsonl(ml_path(cfg))] == [None, 0.0125]


def test_non_finite_loss_is_null_in_jsonl_and_nan_on_the_console(cfg, clock, dtrain_logger):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.float32) as ml:
        clock.now += 1.0
        record = ml.log(1, step_metrics(loss=float("nan")), 100)
    assert math.isnan(record["loss"])
    assert read_jsonl(ml_path(cfg))[0]["loss"] is None
    assert "loss nan" in dtrain_logger.messages[-1]


def test_tensorboard_events_are_written_and_readable(cfg, clock, fake_peak):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.bfloat16) as ml:
        for step in (1, 10):
            clock.now += 1.0
            ml.log(step, step_metrics(loss=3.0 / step), 1000)
    events = EventAccumulator(str(ml_path(cfg, "tb")))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib"} <= tags
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == [1, 10]
    assert [e.value for e in losses] == pytest.approx([3.0, 0.3])


def test_tensorboard_can_be_disabled(cfg, clock):
    cfg.metrics.enable_tensorboard = False
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.float32) as ml:
        clock.now += 1.0
        ml.log(1, step_metrics(), 100)
    assert not ml_path(cfg, "tb").exists()
    assert ml_path(cfg).exists()


def test_only_rank0_writes_by_default(cfg, clock):
    with metrics_logger(cfg, 1, 2, 1e6, CPU, torch.float32) as ml:
        clock.now += 1.0
        ml.log(1, step_metrics(), 100)
    assert not ml_path(cfg, "").exists()


def test_save_for_all_ranks_gives_each_rank_its_own_files(cfg, clock):
    cfg.metrics.save_for_all_ranks = True
    for rank in (0, 1):
        with metrics_logger(cfg, rank, 2, 1e6, CPU, torch.float32) as ml:
            clock.now += 1.0
            ml.log(1, step_metrics(), 100)
    for rank in (0, 1):
        assert len(read_jsonl(ml_path(cfg, f"metrics_rank{rank}.jsonl"))) == 1
        assert any(ml_path(cfg, f"tb/rank_{rank}").iterdir())
    assert not ml_path(cfg).exists()


def test_start_continues_a_resumed_run(cfg, clock):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.float32) as ml:
        clock.now += 30.0  # setup time that start() leaves out
        ml.start(step=50, tokens_seen=5000)
        clock.now += 2.0
        record = ml.log(60, step_metrics(), 1000)
        clock.now += 2.0
        later = ml.log(70, step_metrics(), 1000)
    assert record["tokens_seen"] == 6000
    assert record["eta_s"] is None  # the resumed process's first window
    assert later["eta_s"] == pytest.approx(0.2 * 30)
    assert record["elapsed_s"] == pytest.approx(2.0)


def test_should_log_first_every_log_freq_and_last_step(cfg):
    cfg.training.steps = 25
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.float32) as ml:
        assert [s for s in range(1, 26) if ml.should_log(s)] == [1, 10, 20, 25]


def test_log_rejects_a_step_that_does_not_advance(cfg, clock):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.float32) as ml:
        clock.now += 1.0
        ml.log(10, step_metrics(), 100)
        with pytest.raises(ValueError, match="must come after"):
            ml.log(10, step_metrics(), 100)


def test_metric_names_may_not_shadow_computed_fields(cfg):
    with metrics_logger(cfg, 0, 1, 1e6, CPU, torch.float32) as ml:
        with pytest.raises(ValueError, match="tps"):
            ml.log(1, {"tps": torch.tensor(1.0)}, 100)


def test_read_metric_values_mixes_tensors_and_numbers_in_order():
    values = read_metric_values({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor([3.0], dtype=torch.bfloat16)})
    assert values == {"a": 1.5, "b": 2.0, "c": 3.0}
    assert list(values) == ["a", "b", "c"]


def test_read_metric_values_rejects_non_scalar_tensors():
    with pytest.raises(ValueError, match="'loss'"):
        read_metric_values({"loss": torch.ones(2)})


@pytest.mark.parametrize(
    "seconds, text", [(None, "-"), (float("inf"), "-"), (5, "0:00:05"), (3725, "1:02:05"), (90061, "1d 01:01:01")]
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.cuda
def test_cuda_metrics_log_reads_device_tensors(cfg):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    metrics = {"loss": torch.tensor(2.0, device=device), "grad_norm": torch.tensor(0.5, device=device), "lr": 1e-3}
    with metrics_logger(cfg, 0, 1, 1e6, device, torch.bfloat16) as ml:
        record = ml.log(1, metrics, 100)
    assert (record["loss"], record["grad_norm"]) == (2.0, 0.5)
    assert record["memory_gib"] > 0
