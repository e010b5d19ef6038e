"""A dataset mixture's per-source fields in metrics.jsonl, TensorBoard and the console (source_metrics.py)."""

import json
import math
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dtrain.metrics.logger import MetricsLogger

CPU = torch.device("cpu")


def mixture_step(web_loss: float, web_tokens: int, code_loss: float, code_tokens: int) -> dict:
    """What train_step returns for a mixture of `web` and `code`, and the loop adds (tokens_seen/<name>)."""
    total = web_tokens + code_tokens
    step_loss = (web_loss * web_tokens + (code_loss * code_tokens if code_tokens else 0)) / total
    return {
        "loss": torch.tensor(step_loss), "grad_norm": torch.tensor(1.0), "lr": 1e-3,
        "loss/web": torch.tensor(web_loss, dtype=torch.float64), "tokens/web": torch.tensor(float(web_tokens)),
        "loss/code": torch.tensor(code_loss, dtype=torch.float64), "tokens/code": torch.tensor(float(code_tokens)),
        "tokens_seen/web": 7000, "tokens_seen/code": 3000,
    }


def test_each_source_s_loss_tokens_and_share_reach_every_sink_and_one_console_line(cfg, dtrain_logger):
    cfg.metrics.enable_tensorboard = True
    with MetricsLogger(cfg.metrics, cfg.job.dump_folder, 100, 0, 1, 1e6, CPU, torch.float32) as ml:
        ml.log(1, mixture_step(2.0, 300, 3.0, 100), 400)
        # No `code` sample in this step: its loss is 0/0 = NaN, written as null and left out of TensorBoard.
        ml.log(10, mixture_step(1.5, 400, math.nan, 0), 400)
    lines = (Path(cfg.job.dump_folder) / "metrics.jsonl").read_text().splitlines()
    first, second = (json.loads(line) for line in lines)
    assert first["loss/web"] == 2.0 and first["tokens/web"] == 300 and first["token_share/web"] == 0.75
    assert first["loss/code"] == 3.0 and first["tokens/code"] == 100 and first["token_share/code"] == 0.25
    assert first["tokens_seen/web"] == 7000 and first["tokens_seen/code"] == 3000
    assert second["loss/code"] is None and second["tokens/code"] == 0 and second["token_share/code"] == 0.0
    events = EventAccumulator(str(Path(cfg.job.dump_folder) / cfg.metrics.save_tb_folder))
    events.Reload()
    assert [e.value for e in events.Scalars("loss/web")] == [2.0, 1.5]
    assert [e.step for e in events.Scalars("loss/code")] == [1]
    assert [e.value for e in events.Scalars("token_share/web")] == [0.75, 1.0]
    console = dtrain_logger.messages[-3:]
    assert console[0] == "sources  web loss 2.0000 share 75.0%  code loss 3.0000 share 25.0%"
    assert console[1].startswith("step  10/100")
    assert console[2] == "sources  web loss 1.5000 share 100.0%  code loss - share 0.0%"


def test_a_run_without_a_mixture_logs_no_sources_line(cfg, dtrain_logger):
    with MetricsLogger(cfg.metrics, cfg.job.dump_folder, 100, 0, 1, 1e6, CPU, torch.float32) as ml:
        record = ml.log(1, {"loss": torch.tensor(2.0), "grad_norm": torch.tensor(1.0), "lr": 1e-3}, 400)
    assert not any(key.startswith(("loss/", "tokens/", "token_share/")) for key in record)
    assert not any(message.startswith("sources") for message in dtrain_logger.messages)
