"""Fault soak: kill -9 a training run at random moments, rerun the same command until it finishes, then check that
its loss curve equals an uninterrupted run's bit for bit and that no process outlived any of its runs.

    python scripts/soak.py --kills 20 --nproc 1 --steps 200 --seed 0
    python scripts/soak.py --kills 20 --nproc 2 --steps 200 --seed 0
    python scripts/soak.py --kills 3 --nproc 1 --steps 12 --interval 2   # as CI does (tests/reliability/test_soak.py)

The run is `./run_train.sh` as a user starts it: the debug model on the built-in corpus in float32, a checkpoint
every `--interval` steps, `--keep` of them kept (so every commit prunes), async saves (a background copy and write
while the next steps train), one data loader worker process per rank, metrics every step. First an uninterrupted
reference run, then the soaked run: before each kill the soak waits for a random number of new steps and then for
a random kind of moment (start-up, a step, an async save in flight, a commit, the pruning after it), and kills
with SIGKILL one of: the launcher (the PID of ./run_train.sh), its process group, torchrun, one rank, one data
loader worker, or every process of the run at once. It then waits for the run to end, checks that every process
of the run is gone within seconds, and starts the same command again. When a run finishes before all kills are
spent, a fresh run folder starts another round; so the soak runs as long as --kills asks.

A finished round passes when the last record of every step in metrics.jsonl (a resumed run appends the steps it
trains again) has the reference's loss, grad_norm, lr and tokens_seen exactly, and its checkpoint folder holds
only committed checkpoints. Each process of an attempt is found by a variable in its environment, so an orphan
re-parented away from the run is still found. Choices come from --seed, so a failing soak replays the same kinds
of kills (the timing of a moment on a busy machine varies). Exit status 1 on any mismatch, leftover process or
failed restart; the work folder is then kept.
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import collections
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# soak_attempts.py and soak_processes.py sit beside this script, which runs as a script (python scripts/soak.py):
# its folder is on sys.path.
from soak_attempts import Attempt, Options, last_line, metric_lines, start
from soak_processes import kill_everything, processes, roles, sigkill, wait_until_gone

# How long a run may take to end after a kill (torchrun gives the surviving ranks 30 s after one was killed).
END_TIMEOUT_S = 120.0
COMPARED = ("loss", "grad_norm", "lr", "tokens_seen")
MOMENTS = {"start-up": 1, "step": 2, "save": 2, "commit": 1, "prune": 1}  # kind of moment: weight
POLL_S = 0.001


class SoakFailure(Exception):
    """The soak found a fault: the message says which."""


# -- when to kill, whom, and what it hit ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Pace:
    """Timings of the reference run, which scale the random delays."""

    startup_s: float
    step_s: float


@dataclass
class FolderState:
    new_steps: int
    last_step: int
    partials: list[str]
    committing: list[str]
    committed: list[int]
    pruning: list[str]  # committed checkpoints on their way out (`step-N.deleting`, as keep_latest_k renames them)


def folder_state(run_dir: Path, attempt: Attempt) -> FolderState:
    lines = metric_lines(run_dir)
    try:
        last_step = json.loads(lines[-1])["step"] if lines else 0
    except ValueError:  # not one record: compare() reports it once the round is done
        last_step = 0
    folder = run_dir / "checkpoint"
    partials, committing, committed, pruning = [], [], [], []
    for entry in (sorted(folder.iterdir()) if folder.is_dir() else []):
        if entry.name.endswith(".partial"):
            partials.append(entry.name)
            if any((entry / name).exists() for name in ("dtrain_commit.json", "dtrain_commit.json.tmp")):
                committing.append(entry.name)
        elif entry.name.endswith(".deleting"):
            pruning.append(entry.name)
        elif re.fullmatch(r"step-\d+", entry.name) and (entry / "dtrain_commit.json").is_file():
            committed.append(int(entry.name[len("step-"):]))
    return FolderState(len(lines) - attempt.lines_at_start, last_step, partials, committing, sorted(committed),
                       pruning)


def describe_hit(state: FolderState, o: Options) -> tuple[str, str]:
    """(category, description) of what a kill at `state` interrupted."""
    if state.new_steps <= 0 and not state.partials:
        return "start-up", "start-up (no step logged yet by this attempt)"
    training = f"step {state.last_step + 1}" if state.last_step < o.steps else "the end of the run"
    if state.committing:
        return "commit", f"commit of {state.committing[0]} (record written, not yet renamed), during {training}"
    if state.partials:
        return "save", f"async save {state.partials[0]} in flight, during {training}"
    if state.pruning or len(state.committed) > o.keep:
        doomed = ", ".join(state.pruning) or "not yet renamed"
        return "prune", f"pruning after step-{(state.committed or [0])[-1]} ({doomed}), during {training}"
    return "step", training


def wait_until(attempt: Attempt, condition, timeout: float, poll_s: float = POLL_S) -> bool:
    """Poll `condition` until it holds (True), the attempt ends or time runs out (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if attempt.ended() or time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def sleep_while_running(attempt: Attempt, seconds: float) -> bool:
    return not wait_until(attempt, lambda: False, seconds) and not attempt.ended()


def reach_moment(moment: str, steps_first: int, rng: random.Random, attempt: Attempt, run_dir: Path,
                 o: Options, pace: Pace) -> bool:
    """Wait for a moment of kind `moment` after `steps_first` new steps; False when the run ended first."""
    if moment == "start-up":
        return sleep_while_running(attempt, rng.uniform(0, pace.startup_s))
    timeout = o.attempt_timeout
    if not wait_until(attempt, lambda: folder_state(run_dir, attempt).new_steps >= steps_first, timeout):
        return False
    if moment == "step":
        return sleep_while_running(attempt, rng.uniform(0, pace.step_s))
    if moment == "save":  # the background copy and write run while the next `interval` steps train
        if not wait_until(attempt, lambda: folder_state(run_dir, attempt).partials, timeout):
            return False
        return sleep_while_running(attempt, rng.uniform(0, pace.step_s * o.interval))
    newest = (folder_state(run_dir, attempt).committed or [0])[-1]

    def committed_or_committing() -> bool:
        state = folder_state(run_dir, attempt)
        return bool((moment == "commit" and state.committing) or (state.committed or [0])[-1] > newest)

    # A commit is a few milliseconds (record, rename, fsync), and pruning follows the rename at once.
    return wait_until(attempt, committed_or_committing, timeout) and sleep_while_running(attempt, rng.uniform(0, 0.003))


def victims(target: str, rng: random.Random, attempt: Attempt) -> tuple[str, list[int]]:
    """(what was killed, pids) for a target kind, or the launcher when that kind has no process right now."""
    procs = processes(attempt.tag)
    named = roles(procs, attempt.process.pid)
    kinds = {
        "torchrun": [p for p in named if named[p] == "torchrun"],
        "rank": [p for p in named if named[p].startswith("rank ")],
        "data worker": [p for p in named if named[p].startswith("data worker")],
    }
    if target == "all":
        return f"all {len(procs)} processes", [p.pid for p in procs]
    if target == "group":
        return "the launcher's process group", [-attempt.process.pid]
    if target in kinds and kinds[target]:
        pid = rng.choice(sorted(kinds[target]))
        return f"{named[pid]} (pid {pid})", [pid]
    return f"launcher (pid {attempt.process.pid})", [attempt.process.pid]


def targets(o: Options) -> list[str]:
    kinds = ["launcher", "group", "all"]
    if o.nproc > 1:
        kinds += ["torchrun", "rank"]
    if o.data_workers > 0:
        kinds.append("data worker")
    return kinds


# -- the soak -------------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    kills: int = 0
    survived: int = 0  # kills after which the run went on (a data loader worker it needed no more)
    restarts: int = 0
    rounds: int = 0
    compared: int = 0  # finished rounds whose curve was compared
    tmp_left: collections.Counter = field(default_factory=collections.Counter)  # $TMPDIR entries by name prefix
    hits: collections.Counter = field(default_factory=collections.Counter)
    killed: collections.Counter = field(default_factory=collections.Counter)
    leftovers: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def finish(attempt: Attempt, what: str, tally: Tally) -> None:
    """After the attempt's user process ended: every other process of it must be gone within GRACE_S."""
    left = wait_until_gone(attempt.tag)
    tally.leftovers += left
    if left:
        raise SoakFailure(f"{len(left)} process(es) outlived {what}: {'; '.join(left)}")


def reference_run(o: Options, tally: Tally) -> tuple[dict[int, dict], Pace]:
    run_dir = o.work_dir / "reference"
    attempt = start(o, run_dir, f"{o.seed}-reference-{os.getpid()}", o.work_dir / "reference.log", "reference")
    first_step_at = None
    try:
        deadline = attempt.started + o.attempt_timeout
        while not attempt.ended():
            if first_step_at is None and metric_lines(run_dir):
                first_step_at = time.monotonic()
            if time.monotonic() > deadline:
                raise SoakFailure(f"the reference run took over {o.attempt_timeout:.0f} s (log: {attempt.log})")
            time.sleep(0.01)
        if attempt.process.returncode != 0:
            raise SoakFailure(f"the reference run failed: {last_line(attempt.log)} (log: {attempt.log})")
        finish(attempt, "the reference run", tally)
    finally:
        kill_everything(attempt.tag)
    records = [json.loads(line) for line in metric_lines(run_dir)]
    step_s = (records[-1]["elapsed_s"] - records[0]["elapsed_s"]) / max(len(records) - 1, 1)
    startup = (first_step_at or time.monotonic()) - attempt.started
    return curve(records), Pace(startup, step_s)


def curve(records: list[dict]) -> dict[int, dict]:
    """{step: compared values}, the last record of a step winning (a resumed run logs again what it retrains)."""
    return {r["step"]: {key: r.get(key) for key in COMPARED} for r in records}


def compare(run_dir: Path, reference: dict[int, dict], o: Options) -> list[str]:
    records, problems = [], []
    for number, line in enumerate(metric_lines(run_dir), 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            problems.append(f"{run_dir.name}: metrics.jsonl line {number} is not one JSON record: {line[:200]!r}")
    soaked = curve(records)
    if sorted(soaked) != list(range(1, o.steps + 1)):
        problems.append(f"{run_dir.name}: logged steps {sorted(set(range(1, o.steps + 1)) - set(soaked))} missing")
    for step in sorted(set(soaked) & set(reference)):
        if soaked[step] != reference[step]:
            problems.append(f"{run_dir.name}: step {step} has {soaked[step]}, the reference {reference[step]}")
    folder = run_dir / "checkpoint"
    junk = [p.name for p in folder.iterdir() if not (p / "dtrain_commit.json").is_file()] if folder.is_dir() else []
    if junk:
        problems.append(f"{run_dir.name}: the checkpoint folder holds uncommitted leftovers {sorted(junk)}")
    return problems


def soak(o: Options, tally: Tally, out=sys.stdout) -> None:
    """Soak one process count; `tally` is filled as it goes (and holds what was done when a SoakFailure ends it)."""
    rng = random.Random(o.seed)
    (o.work_dir / "tmp").mkdir(parents=True, exist_ok=True)
    print(f"soak: {o.nproc} process(es), {o.steps} steps, {o.kills} kills, seed {o.seed}, in {o.work_dir}",
          file=out, flush=True)
    reference, pace = reference_run(o, tally)
    print(f"reference run: {o.steps} steps; start-up {pace.startup_s:.1f} s, {pace.step_s:.3f} s a step",
          file=out, flush=True)
    while tally.kills < o.kills or tally.rounds == 0:
        tally.rounds += 1
        run_dir = o.work_dir / f"round-{tally.rounds}"
        attempt_no = 0
        while True:
            attempt_no += 1
            tag = f"{o.seed}-{tally.rounds}-{attempt_no}-{os.getpid()}"
            attempt = start(o, run_dir, tag, o.work_dir / f"round-{tally.rounds}-attempt-{attempt_no}.log",
                            f"round {tally.rounds}, attempt {attempt_no}")
            try:
                outcome = "survived"
                while outcome == "survived" and tally.kills < o.kills:
                    outcome = kill_once(o, rng, attempt, run_dir, pace, tally, out)
                if outcome != "ended":
                    try:
                        attempt.process.wait(timeout=max(o.attempt_timeout - (time.monotonic() - attempt.started), 1))
                    except subprocess.TimeoutExpired:
                        raise SoakFailure(f"attempt {attempt_no} took over {o.attempt_timeout:.0f} s "
                                          f"(log: {attempt.log})") from None
                    if attempt.process.returncode != 0:
                        raise SoakFailure(f"round {tally.rounds}, attempt {attempt_no} failed without a kill: "
                                          f"{last_line(attempt.log)} (log: {attempt.log})")
                    finish(attempt, f"its run ({attempt.label})", tally)
                    break
            finally:
                kill_everything(attempt.tag)
            tally.restarts += 1
        problems = compare(run_dir, reference, o)
        tally.compared += 1
        tally.mismatches += problems
        verdict = "equal to the reference, bit for bit" if not problems else f"DIFFERS: {problems[0]}"
        print(f"round {tally.rounds}: finished after {attempt_no - 1} restart(s); curve {verdict}", file=out,
              flush=True)
        if problems:
            break
    # Files, not processes: what killed runs left in their $TMPDIR (torch's inductor cache excepted), for the record.
    tally.tmp_left.update(re.split(r"[._]", p.name)[0] for p in (o.work_dir / "tmp").iterdir()
                          if not p.name.startswith("torchinductor_"))


def kill_once(o: Options, rng: random.Random, attempt: Attempt, run_dir: Path, pace: Pace, tally: Tally,
              out) -> str:
    """Wait for a random moment, SIGKILL a random target, and wait for the whole run to end. Returns "ended";
    "survived" when the run went on (a data loader worker is only missed once its rank needs more documents);
    "finished" when the run finished before the moment came or despite the kill."""
    moment = rng.choices(list(MOMENTS), weights=list(MOMENTS.values()))[0]
    # Spread the kills left over the steps left: on average, the steps left / (kills left + 1) new steps first.
    resumes_at = (folder_state(run_dir, attempt).committed or [0])[-1]
    steps_first = rng.randint(1, max(2 * (o.steps - resumes_at) // (o.kills - tally.kills + 1), 1))
    target = rng.choice(targets(o))
    if not reach_moment(moment, steps_first, rng, attempt, run_dir, o, pace):
        return "finished"
    what, pids = victims(target, rng, attempt)
    category, hit = describe_hit(folder_state(run_dir, attempt), o)
    at = time.monotonic() - attempt.started
    for pid in pids:
        sigkill(pid)  # a negative pid: the process group
    killed_at = time.monotonic()
    lines_at_kill = len(metric_lines(run_dir))
    # Past the next checkpoint after the kill: the run went on.
    went_on = wait_until(attempt, lambda: len(metric_lines(run_dir)) >= lines_at_kill + o.interval + 2,
                         END_TIMEOUT_S, poll_s=0.05)
    if not went_on and not attempt.ended():
        raise SoakFailure(f"the run neither ended nor went on within {END_TIMEOUT_S:.0f} s of killing {what} "
                          f"(log: {attempt.log})")
    line = f"kill {tally.kills + 1}/{o.kills}: SIGKILL {what} at {at:.2f} s into {attempt.label}: {hit}; "
    if went_on or attempt.process.returncode == 0:
        if {attempt.process.pid, -attempt.process.pid} & set(pids):
            return "finished"  # the run was done in the moment before the kill: nothing was interrupted
        tally.kills += 1
        tally.survived += 1
        tally.hits[category] += 1
        tally.killed[target] += 1
        print(f"{line}the run went on ({len(metric_lines(run_dir)) - lines_at_kill} steps logged since)", file=out,
              flush=True)
        return "survived" if went_on else "finished"
    ended_s = time.monotonic() - killed_at
    tally.kills += 1
    tally.hits[category] += 1
    tally.killed[target if not what.startswith("launcher") else "launcher"] += 1
    left = wait_until_gone(attempt.tag)
    gone = f"{len(left)} process(es) left" if left else f"all gone {time.monotonic() - killed_at:.1f} s later"
    tally.leftovers += left
    print(f"{line}./run_train.sh ended {ended_s:.1f} s later, {gone}", file=out, flush=True)
    if left:
        raise SoakFailure(f"{len(left)} process(es) outlived the killed run: {'; '.join(left)}")
    return "ended"


# -- the command line ----------------------------------------------------------------------------------------------
class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                           formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--kills", type=int, default=20, help="kills per process count (default 20)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1], help="process counts to soak, one after another")
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices (default 0)")
    parser.add_argument("--interval", type=int, default=3, help="checkpoint.interval (default 3)")
    parser.add_argument("--keep", type=int, default=2, help="checkpoint.keep_latest_k (default 2)")
    parser.add_argument("--seq-len", type=int, default=32, help="training.seq_len (default 32)")
    parser.add_argument("--data-workers", type=int, default=1, help="data loader worker processes per rank (default 1)")
    parser.add_argument("--attempt-timeout", type=float, default=900, help="seconds one attempt may run (default 900)")
    parser.add_argument("--work-dir", type=Path, help="where the runs go (default: a new temporary folder)")
    parser.add_argument("--keep-work-dir", action="store_true", help="keep the work folder also when the soak passes")
    args = parser.parse_args(argv)
    for name, least in (("kills", 0), ("steps", 2), ("interval", 1), ("keep", 1), ("seq_len", 2),
                        ("data_workers", 0), ("attempt_timeout", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is below {least}")
    if any(n < 1 for n in args.nproc):
        parser.error(f"--nproc {' '.join(map(str, args.nproc))}: each must be 1 or more")
    if args.interval >= args.steps:
        parser.error(f"--interval {args.interval} must be below --steps {args.steps}, or nothing is saved mid-run")
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty; give a new or empty folder")
    if not sys.platform.startswith("linux"):
        parser.error("the soak finds a run's processes through /proc: it runs on Linux only")
    return args


def verdict_table(rows: list[tuple[int, Tally]]) -> str:
    lines = ["| procs | kills | run went on | restarts | rounds | wall | curve equal | leftover processes |",
             "|---|---|---|---|---|---|---|---|"]
    for nproc, t in rows:
        minutes, seconds = divmod(round(t.wall_s), 60)
        equal = "no" if t.mismatches else "yes" if t.compared and t.compared == t.rounds else "not reached"
        lines.append(f"| {nproc} | {t.kills} | {t.survived} | {t.restarts} | {t.rounds} | {minutes}m{seconds:02d}s | "
                     f"{equal} | {len(t.leftovers)} |")
    for nproc, t in rows:
        lines.append(f"{nproc} process(es), kills hit: {', '.join(f'{k} {v}' for k, v in sorted(t.hits.items()))}; "
                     f"killed: {', '.join(f'{k} {v}' for k, v in sorted(t.killed.items()))}; "
                     f"left in $TMPDIR: {', '.join(f'{k}* {v}' for k, v in sorted(t.tmp_left.items())) or 'nothing'}")
    return "\n".join(lines)


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    args = parse(argv)
    # SIGTERM (a CI timeout, `timeout`) ends the soak as Ctrl-C does: the current run is killed on the way out.
    signal.signal(signal.SIGTERM, interrupted)
    base = args.work_dir or Path(tempfile.mkdtemp(prefix="dtrain-soak-"))
    rows, failure = [], None
    for nproc in args.nproc:
        o = Options(args.kills, nproc, args.steps, args.seed, args.interval, args.keep, args.seq_len,
                    args.data_workers, args.attempt_timeout, base / f"nproc-{nproc}")
        tally = Tally()
        began = time.monotonic()
        try:
            soak(o, tally)
        except SoakFailure as err:
            failure = f"error: {err}"
        except KeyboardInterrupt:
            failure = "error: interrupted"
        tally.wall_s = time.monotonic() - began
        rows.append((nproc, tally))
        if failure or tally.mismatches:
            break
    print(verdict_table(rows), flush=True)
    if failure or any(t.mismatches for _, t in rows):
        failure = failure or f"error: {next(m for _, t in rows for m in t.mismatches)}"
        print(f"{failure}; work folder kept: {base}", file=sys.stderr)
        return 1
    if not args.keep_work_dir:
        shutil.rmtree(base, ignore_errors=True)
    print("soak passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
