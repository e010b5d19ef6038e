"""Background loading (training.dataloader): the same batches and state as loading in the step, and clean stops."""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dtrain.config.schema import DataLoader as LoaderConfig
from dtrain.data import ByteTokenizer, build_dataloader
from dtrain.data.dataloader import DataLoader
from dtrain.data.sources import DocumentSource
from dtrain.errors import DataError

# 40 short documents of many lengths (some empty): windows cut them everywhere, a pass is 160 tokens (4 batches of
# 2 ranks x 2 sequences x 10 tokens), and worker groups straddle passes.
DOCS = ["abcd"[: i % 5] for i in range(40)]
SETTINGS = [None] + [LoaderConfig(num_workers=w, prefetch_factor=p) for w, p in ((0, 2), (0, 1), (1, 3), (2, 2))]
SETTING_IDS = ["in-step", "thread", "thread-depth1", "1-worker", "2-workers"]


class ListSource(DocumentSource):
    """Documents from a list; position = index. `fail_at` raises `error` when that document is read."""

    description = "test documents"

    def __init__(self, docs=DOCS, fail_at=None, error=None):
        self.docs, self.fail_at, self.error = docs, fail_at, error

    def documents(self, start=0):
        for index in range(start, len(self.docs)):
            if index == self.fail_at:
                raise self.error
            yield index, self.docs[index]


def make_loader(background, rank=0, dp=2, source=None, seq_len=9, lbs=2):
    return DataLoader(
        source or ListSource(), ByteTokenizer(), seq_len, lbs, rank, dp, document_masking=True, background=background
    )


def take(loader, count):
    return [next(loader) for _ in range(count)]


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Loading threads and workers alive when the current test started: loaders of earlier tests in the session
# (training states kept by module fixtures, say) are not this test's to stop.
_EARLIER: set = set()


@pytest.fixture(autouse=True)
def _earlier_background():
    _EARLIER.clear()
    _EARLIER.update(threading.enumerate(), multiprocessing.active_children())
    yield


def no_background_left():
    """Wait (briefly) until no loading thread or worker process started by this test is alive; True when none is."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        threads = [t for t in threading.enumerate() if t.name == "dtrain-data-loading" and t not in _EARLIER]
        workers = [
            p for p in multiprocessing.active_children()
            if p.name.startswith("dtrain-data-worker") and p not in _EARLIER
        ]
        if not threads and not workers:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("background", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("rank", [0, 1])
def test_every_setting_gives_the_same_batches_and_state(background, rank):
    expected_loader = make_loader(None, rank=rank)
    expected = take(expected_loader, 12)  # about three passes over DOCS
    loader = make_loader(background, rank=rank)
    assert_same_batches(take(loader, 12), expected)
    time.sleep(0.2)  # let the background run ahead: the state must still be that of the batches handed out
    assert loader.state_dict() == expected_loader.state_dict() and loader.state_dict()["epoch"] >= 2
    assert loader.sequences_consumed == 12 * 2 * 2
    loader.close()


@pytest.mark.parametrize("background", SETTINGS[1:], ids=SETTING_IDS[1:])
def test_resume_and_rewind_continue_exactly(background):
    reference = take(make_loader(None), 10)
    loader = make_loader(background)
    take(loader, 4)
    time.sleep(0.1)
    state = loader.state_dict()
    assert_same_batches(take(loader, 2), reference[4:6])
    # A resumed loader (any setting) continues with batch 4; this one rewinds to it, and to the start.
    resumed = make_loader(LoaderConfig(num_workers=2))
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 6), reference[4:10])
    loader.load_state_dict(state)
    assert loader.state_dict() == state
    assert_same_batches(take(loader, 3), reference[4:7])
    loader.load_state_dict(make_loader(None).state_dict())
    assert_same_batches(take(loader, 2), reference[:2])
    loader.close()
    resumed.close()
    assert no_background_left()


def test_close_stops_everything_and_a_later_batch_restarts_at_the_state():
    reference = take(make_loader(None), 6)
    loader = make_loader(LoaderConfig(num_workers=2, prefetch_factor=4))
    assert_same_batches(take(loader, 3), reference[:3])
    assert [p for p in multiprocessing.active_children() if p.name.startswith("dtrain-data-worker")]
    loader.close()
    assert no_background_left()
    assert_same_batches(take(loader, 3), reference[3:])  # the batches made ahead before close are made again
    del loader
    gc.collect()
    assert no_background_left()  # dropping the loader stops its thread and workers


def workers_of(loader):
    return sorted(p.pid for p in multiprocessing.active_children() if p.name.startswith("dtrain-data-worker"))


@pytest.mark.parametrize("persistent", [True, False])
def test_persistent_workers_survive_a_rewind(persistent):
    loader = make_loader(LoaderConfig(num_workers=2, persistent_workers=persistent))
    start = loader.state_dict()
    first = take(loader, 3)
    before = workers_of(loader)
    loader.load_state_dict(start)
    assert (workers_of(loader) == before) == persistent  # without persistence they are stopped at the rewind
    assert_same_batches(take(loader, 3), first)
    loader.close()
    assert no_background_left()


@pytest.mark.parametrize("background", SETTINGS, ids=SETTING_IDS)
def test_a_data_error_in_the_background_surfaces_at_its_batch(background):
    bad = ListSource(fail_at=30, error=DataError("test documents: document 30 is unreadable"))
    loader = make_loader(background, source=bad)
    take(loader, 2)  # batches before the bad document come through
    with pytest.raises(DataError) as info:
        take(loader, 20)
    # The message the CLI prints; from a worker, its traceback rides along as a note (shown with DTRAIN_TRACEBACK=1).
    assert str(info.value) == "test documents: document 30 is unreadable"
    with pytest.raises(DataError, match="document 30"):  # and it stays raised
        next(loader)
    loader.close()
    assert no_background_left()


@pytest.mark.parametrize("workers, where", [(0, "background data loading"), (2, "data loader worker [01]")])
def test_a_bug_in_the_background_is_one_line_naming_its_type(workers, where):
    loader = make_loader(LoaderConfig(num_workers=workers), source=ListSource(fail_at=5, error=KeyError("text")))
    with pytest.raises(RuntimeError) as info:
        take(loader, 10)
    assert re.fullmatch(f"{where} failed: KeyError: 'text'", str(info.value))
    loader.close()


def test_a_dataset_without_text_is_refused_with_workers_too(make_config, tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text('{"text": ""}\n' * 5)
    cfg = make_config(**{"training.dataset": "files", "training.dataset_path": str(path)})
    cfg.training.dataloader.num_workers = 2
    loader = build_dataloader(cfg.training, ByteTokenizer(), 0, 1, seed=0)
    with pytest.raises(DataError, match="holds no text"):
        next(loader)
    loader.close()


def test_a_killed_worker_is_an_error_not_a_hang():
    loader = make_loader(LoaderConfig(num_workers=2, prefetch_factor=1), source=ListSource(DOCS * 50))
    next(loader)
    os.kill(workers_of(loader)[0], signal.SIGKILL)
    with pytest.raises(DataError, match="data loader worker [01] exited unexpectedly"):
        take(loader, 500)
    loader.close()
    assert no_background_left()


def test_pin_memory_without_cuda_does_nothing():
    loader = make_loader(LoaderConfig(pin_memory=True))
    batch = next(loader)
    assert batch["input_ids"].is_pinned() == torch.cuda.is_available()
    loader.close()


def test_build_dataloader_loads_in_the_background_as_configured(make_config):
    cfg = make_config(**{"training.seq_len": 16, "training.local_batch_size": 2})
    cfg.training.dataloader.num_workers = 1
    loader = build_dataloader(cfg.training, ByteTokenizer(), 0, 1, seed=0)
    assert "2 batches ahead, 1 worker processes" in repr(loader)
    assert next(loader)["input_ids"].shape == (2, 16)
    loader.close()


SCRIPT = """
from dtrain.config.schema import DataLoader as LoaderConfig
from dtrain.data import ByteTokenizer, DataLoader
from dtrain.data.sources import SyntheticSource

source = SyntheticSource(seed=0, vocab_size=256, seq_len=64)
loader = DataLoader(source, ByteTokenizer(), 64, 2, 0, 1, background=LoaderConfig(num_workers={workers}))
next(loader)
{ending}
"""


@pytest.mark.parametrize(
    "workers, ending", [(0, "raise SystemExit('stopped')"), (2, "pass"), (2, "raise SystemExit('stopped')")]
)
def test_a_process_exits_promptly_with_the_loader_still_running(workers, ending):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    started = time.monotonic()
    script = SCRIPT.format(workers=workers, ending=ending)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == (0 if ending == "pass" else 1), result.stderr
    assert result.stderr.strip() in ("", "stopped")  # no traceback from a thread or a worker
    assert time.monotonic() - started < 30
