"""Validation: the built-in corpus's held-out split, the validation loader, the loss, and the config's refusals.
(Parity of val_loss over the parallel layouts: tests/parallelize/test_parity_validation.py; the whole run through
run_train.sh: tests/e2e/test_run_train_validation.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from dtrain.config import JobConfig, validate_config
from dtrain.config.schema import LRScheduler, Optimizer
from dtrain.data import ByteTokenizer, build_source
from dtrain.data.sources import BUILTIN_HELD_OUT_EVERY, BuiltinSource, _python_files
from dtrain.errors import ConfigError, DataError
from dtrain.metrics import MetricsLogger
from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.parallelize import ParallelDims, get_family
from dtrain.run.layout import check_validation_layout
from dtrain.run.validation import Validator, build_validator, validation_loss
from dtrain.step.executor import LocalExecutor
from dtrain.step.labels import IGNORE_INDEX
from dtrain.step.lr_schedule import build_lr_scheduler
from dtrain.step.optimizer import build_optimizers
from dtrain.step.state import RankCoordinates, StepSetup, TrainState
from dtrain.step.train_step import StepLoss

ARGS = Llama3Args(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, multiple_of=16, max_seq_len=32)


def validation_config(**validation) -> JobConfig:
    cfg = JobConfig()
    cfg.validation.enable = True
    cfg.validation.seq_len, cfg.validation.local_batch_size, cfg.validation.steps = 16, 2, 3
    for key, value in validation.items():
        setattr(cfg.validation, key, value)
    return cfg


def validator_for(cfg: JobConfig, rank: RankCoordinates, device) -> Validator | None:
    return build_validator(cfg.validation, cfg.training, cfg.debug.seed, rank, ByteTokenizer(), device)


# --- the built-in corpus's split --------------------------------------------------------------------------------


def test_builtin_split_is_disjoint_complete_and_deterministic():
    train, held_out = BuiltinSource(split="train"), BuiltinSource(split="validation")
    assert not set(train.files) & set(held_out.files)
    assert sorted(train.files + held_out.files) == sorted(_python_files(train.root))
    assert 0.02 < len(held_out.files) / len(_python_files(train.root)) < 0.1  # about 1 in BUILTIN_HELD_OUT_EVERY
    assert BuiltinSource(split="validation").files == held_out.files
    # Training's builtin data is the training part, whatever [validation] says.
    assert build_source(JobConfig().training, None, seed=0).files == train.files
    assert build_source(JobConfig().training, None, seed=0, split="validation").files == held_out.files


def test_a_files_side_depends_on_its_path_alone(tmp_path):
    names = [f"m{i}.py" for i in range(3 * BUILTIN_HELD_OUT_EVERY)]
    for name in names:
        (tmp_path / name).write_text(f"# {name}\n")
    held_out = set(BuiltinSource(str(tmp_path), split="validation").files)
    assert held_out and len(held_out) < len(names)
    (tmp_path / "sub").mkdir()
    for i in range(50):
        (tmp_path / "sub" / f"new{i}.py").write_text("x = 1\n")
    grown = BuiltinSource(str(tmp_path), split="validation").files
    assert {f for f in grown if "/sub/" not in f} == held_out


def test_validation_synthetic_data_is_not_trainings():
    cfg = JobConfig()
    cfg.training.dataset = "synthetic"
    tokenizer = ByteTokenizer()
    train = next(build_source(cfg.training, tokenizer, seed=0).documents())[1]
    held_out = next(build_source(cfg.training, tokenizer, seed=0, split="validation").documents())[1]
    assert len(train) != len(held_out) or (train != held_out).any()


# --- the validation loader and the loss ----------------------------------------------------------------------


def take(validator, count):
    loader = validator.new_loader()
    return [next(loader) for _ in range(count)]


def test_every_evaluation_reads_the_same_batches_from_the_start():
    validator = validator_for(validation_config(), RankCoordinates(), torch.device("cpu"))
    first, second = take(validator, 3), take(validator, 3)
    for a, b in zip(first, second):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert first[0]["input_ids"].shape == (2, 16)
    assert not torch.equal(first[0]["input_ids"], first[1]["input_ids"])


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (1, True)])
def test_background_loading_reads_the_same_batches_at_every_evaluation(num_workers, persistent):
    cfg = validation_config()
    cfg.validation.dataloader.num_workers, cfg.validation.dataloader.persistent_workers = num_workers, persistent
    plain = take(validator_for(validation_config(), RankCoordinates(), "cpu"), 3)
    validator = validator_for(cfg, RankCoordinates(), "cpu")
    for _ in range(2):  # the second evaluation rewinds the background loader to the first batch
        for a, b in zip(take(validator, 3), plain):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_each_dp_rank_reads_its_slice_of_the_global_batch():
    whole = take(validator_for(validation_config(local_batch_size=4), RankCoordinates(), "cpu"), 2)
    halves = [
        take(validator_for(validation_config(), RankCoordinates(dp_rank=r, dp_size=2), "cpu"), 2)
        for r in range(2)
    ]
    for index, batch in enumerate(whole):
        assert torch.equal(batch["input_ids"], torch.cat([halves[0][index]["input_ids"], halves[1][index]["input_ids"]]))


def test_steps_minus_one_counts_the_whole_set_in_full_global_batches(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 98)  # [BOS] 98 bytes [EOS]: 100 tokens
    (tmp_path / "b.txt").write_text("y" * 198)  # 200 tokens: 300 in all = 17 windows of 17, 8 global batches of 2
    cfg = validation_config(dataset="files", dataset_path=str(tmp_path), steps=-1)
    assert validator_for(cfg, RankCoordinates(), "cpu").batches == 8
    assert validator_for(cfg, RankCoordinates(dp_rank=1, dp_size=2), "cpu").batches == 4
    cfg.validation.seq_len = 400
    with pytest.raises(DataError, match="fewer than one global batch"):
        validator_for(cfg, RankCoordinates(), "cpu")


def test_off_means_no_validator():
    assert validator_for(JobConfig(), RankCoordinates(), "cpu") is None


class NoData:
    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


def small_state() -> TrainState:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    optimizer = build_optimizers([model], Optimizer(lr=1e-2), torch.device("cpu"))
    scheduler = build_lr_scheduler(optimizer, 10, LRScheduler())
    setup = StepSetup(LocalExecutor(StepLoss()), seed=0, max_norm=1.0)
    return TrainState([model], optimizer, scheduler, NoData(), setup)


def test_validation_loss_is_the_mean_over_all_valid_tokens_without_gradients():
    state = small_state()
    validator = validator_for(validation_config(), RankCoordinates(), "cpu")
    batches = take(validator, 3)
    batches[1]["labels"][0, :5] = IGNORE_INDEX
    model = state.model_parts[0]
    with torch.no_grad():
        logits = torch.cat([model(b["input_ids"]) for b in batches]).flatten(0, 1)
        labels = torch.cat([b["labels"] for b in batches]).flatten()
        expected = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX).item()
    loss = validation_loss(state, batches)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert model.training and all(p.grad is None for p in model.parameters())


def test_validator_runs_its_batches_and_reports_perplexity():
    state = small_state()
    validator = validator_for(validation_config(freq=5), RankCoordinates(), torch.device("cpu"))
    values = validator.run(state)
    assert values["val_loss"] == pytest.approx(validation_loss(state, take(validator, 3)).item())
    assert values["val_perplexity"] == pytest.approx(math.exp(values["val_loss"]))
    assert [step for step in range(12) if validator.due(step)] == [5, 10]


def test_log_validation_writes_its_own_records(tmp_path, caplog):
    cfg = JobConfig()
    metrics = MetricsLogger(cfg.metrics, tmp_path, 20, 0, 1, 1.0, torch.device("cpu"), torch.float32)
    with caplog.at_level("INFO"):
        record = metrics.log_validation(10, {"val_loss": 2.0, "val_perplexity": math.exp(2.0)})
    metrics.close()
    assert record == {"step": 10, "val_loss": 2.0, "val_perplexity": math.exp(2.0)}
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [record]
    assert "validation  step 10/20  val_loss 2.0000  val_perplexity 7.3891" in caplog.text


# --- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "validation, message",
    [
        (dict(steps=0), "validation.steps must be -1"),
        (dict(dataset="c4_test_typo"), "validation.dataset must be one of builtin, "),
        (dict(dataset="files"), "validation.dataset = files needs validation.dataset_path"),
        (dict(dataset="synthetic", steps=-1), "validation.steps = -1 .* synthetic never ends"),
    ],
)
def test_config_refuses(validation, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(validation_config(**validation))


def test_config_accepts_what_it_promises():
    for kind in ("builtin", "c4", "c4_validation"):
        validate_config(validation_config(dataset=kind, steps=-1))
    validate_config(validation_config(dataset="synthetic", steps=4))
    off = JobConfig()
    off.validation.dataset = "anything: validation is off"
    validate_config(off)


def test_pipeline_microbatches_must_divide_the_validation_batch():
    cfg = validation_config(local_batch_size=3)
    cfg.parallelism.pipeline_parallel_degree = 2
    cfg.parallelism.pipeline_parallel_microbatch_size = 2
    with pytest.raises(ConfigError, match=r"validation.local_batch_size \(3\) must be a multiple"):
        validate_config(cfg)


def test_layout_checks_name_the_validation_keys():
    family = get_family("llama3")
    cfg = validation_config(seq_len=18)
    with pytest.raises(ConfigError, match=r"^validation.seq_len=18 is not a multiple of 2 × "):
        check_validation_layout(cfg.validation, cfg.parallelism, ParallelDims(2, cp=2, dp_shard=1), family, ARGS)
    cfg = validation_config(local_batch_size=1)
    cfg.parallelism.pipeline_parallel_degree = 2
    with pytest.raises(ConfigError, match="validation.local_batch_size"):
        check_validation_layout(cfg.validation, cfg.parallelism, ParallelDims(2, pp=2, dp_shard=1), family, ARGS)
    cfg = validation_config()
    check_validation_layout(cfg.validation, cfg.parallelism, ParallelDims(2, cp=2, dp_shard=1), family, ARGS)


def test_trainings_own_data_is_refused(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("some text")
    cfg = validation_config(dataset="files", dataset_path=str(tmp_path / "data" / "a.txt"))
    cfg.training.dataset, cfg.training.dataset_path = "files", str(tmp_path / "data")
    with pytest.raises(ConfigError, match="reads training's data"):
        validator_for(cfg, RankCoordinates(), "cpu")
    cfg.training.dataset, cfg.training.dataset_path = "c4", ""
    cfg.validation.dataset, cfg.validation.dataset_path = "c4", ""
    with pytest.raises(ConfigError, match="validation.dataset = c4 .* reads training's data"):
        validator_for(cfg, RankCoordinates(), "cpu")
    # A mixture's every entry counts as training's data.
    cfg.training.dataset, cfg.training.dataset_mixture = "mixture", [["builtin", "1"], ["files", str(tmp_path), "1"]]
    cfg.validation.dataset, cfg.validation.dataset_path = "files", str(tmp_path / "data")
    with pytest.raises(ConfigError, match="reads training's data"):
        validator_for(cfg, RankCoordinates(), "cpu")


def test_missing_validation_data_names_the_validation_keys(tmp_path):
    cfg = validation_config(dataset="files", dataset_path=str(tmp_path / "missing"))
    with pytest.raises(DataError, match=r"^validation.dataset_path .* does not exist"):
        validator_for(cfg, RankCoordinates(), "cpu")


def test_validation_seq_len_fits_the_model():
    from dtrain.run.prepare import model_args

    cfg = validation_config(seq_len=4096)
    cfg.training.seq_len = 128
    assert model_args(cfg, get_family("llama3").model, 258).max_seq_len >= 4096
    cfg.validation.enable = False
    assert model_args(cfg, get_family("llama3").model, 258).max_seq_len < 4096

