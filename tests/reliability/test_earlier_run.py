"""One run, one metrics file: a new run in an earlier run's folder moves that run's metrics, TensorBoard folder and
config aside instead of appending to them; a resumed run (or a rejoining replica group) continues them."""

import json

from dtrain.config.schema_observe import Metrics
from dtrain.reliability.earlier_run import EARLIER_RUNS, set_aside_earlier_run


def earlier_run(folder, steps):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)
                                          + '{"step": 4')  # the last line cut short by a kill
    (folder / "tb").mkdir()
    (folder / "tb" / "events").write_text("x")
    (folder / "config.toml").write_text("[job]\n")
    (folder / "checkpoint").mkdir(exist_ok=True)


def test_a_new_run_moves_the_earlier_runs_files_aside_and_says_so(tmp_path, caplog):
    run = tmp_path / "run"
    earlier_run(run, [1, 2, 3])
    with caplog.at_level("INFO", logger="dtrain"):
        moved = set_aside_earlier_run(run, Metrics(), continues_a_run=False)
    assert moved.parent == run / EARLIER_RUNS
    assert sorted(p.name for p in moved.iterdir()) == ["config.toml", "metrics.jsonl", "tb"]
    assert not (run / "metrics.jsonl").exists() and (run / "checkpoint").is_dir()  # checkpoints stay
    assert "held an earlier run's metrics (steps 1..3)" in caplog.text
    earlier_run(run, [1])  # again within the same second: a folder of its own
    again = set_aside_earlier_run(run, Metrics(), continues_a_run=False)
    assert again != moved and (again / "metrics.jsonl").is_file()


def test_a_resumed_run_or_a_folder_without_metrics_keeps_its_files(tmp_path):
    run = tmp_path / "run"
    earlier_run(run, [1, 2])
    assert set_aside_earlier_run(run, Metrics(), continues_a_run=True) is None
    assert (run / "metrics.jsonl").is_file()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.toml").write_text("[job]\n")
    assert set_aside_earlier_run(fresh, Metrics(), continues_a_run=False) is None
    assert (fresh / "config.toml").is_file()
