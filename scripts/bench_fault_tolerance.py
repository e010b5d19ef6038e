"""What losing one process costs a run, on CPU: fault-tolerant replica groups vs a whole-job restart.

Both runs train the same model, steps and global batch (fp32, synthetic data), both checkpoint every
--checkpoint_interval steps, and both lose one process to kill -9 right after step --kill_step:
- fault tolerance: 2 replica groups of 1 process (torchft, in-process lighthouse); group 1 is killed and started
  again at once with the same command. The survivor trains on: reported are its gap across the kill and across
  the rejoin beside its median step, its discarded steps, the steps it trained alone (the lost group's samples are
  skipped), and how long the restarted group took from its start to "recovered live" (and, of that, the state
  transfer: ft/recovery_seconds).
- whole-job restart: one job of 2 processes (FSDP) with MAX_RESTARTS=1; worker rank 1 is killed, torchrun
  restarts both from the last checkpoint. Reported are the time from the kill to the first step after the
  restart and the steps done again (kill step - last checkpoint).
Step times are when each step's line reached metrics.jsonl (polled every 10 ms); the runs are stopped (kill -9)
5 steps after the rejoin and after the restart. Prints a Markdown table for
docs/benchmarks.md (--json: the figures as JSON).

--goodput_seconds T measures goodput instead: each way runs for T seconds while one process is killed every
--failure_every seconds (fault tolerance: group 1, started again at once; whole job: worker rank 1, with
MAX_RESTARTS large enough for every kill), and reports the job's steps and tokens per hour against the rate of its
own steps before the first kill (the failure-free rate).

    python scripts/bench_fault_tolerance.py                    # kill after step 25, checkpoints every 10
    python scripts/bench_fault_tolerance.py --kill_step 8 --checkpoint_interval 5 --json
    python scripts/bench_fault_tolerance.py --goodput_seconds 240 --failure_every 30
"""

from __future__ import annotations

import _repo_env  # noqa: F401  (first: re-runs this script in the repository's .venv when needed)

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its lighthouse logs every quorum at INFO
from torchft.coordination import LighthouseServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN_SECONDS = 600  # `timeout` on every launch: nothing outlives a stuck benchmark for long
POLL_SECONDS = 0.01
STEPS_AFTER = 5  # steps measured after the rejoin or the restart; then the runs are stopped


class Launch:
    """One ./run_train.sh launch in a session of its own, its output in `log`, its metrics' arrival times watched."""

    def __init__(self, args: list[str], run_dir: Path, **env: str):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = run_dir / "bench.log"
        self.started = time.monotonic()
        # The test environment's interpreter, as run_train.sh would pick it when this one is active.
        full_env = {**os.environ, "VIRTUAL_ENV": sys.prefix, "OMP_NUM_THREADS": "1", **env,
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        # A launch again in the same folder (a restarted group) appends: what was there is not its own.
        metrics = run_dir / "metrics.jsonl"
        self._read = len(metrics.read_text()) if metrics.exists() else 0
        self._log_read = len(self.log.read_text(errors="replace").splitlines()) if self.log.exists() else 0
        self.steps: list[tuple[float, dict]] = []  # (arrival time, metrics record), in order
        self.log_lines: list[tuple[float, str]] = []  # (arrival time, line)
        with self.log.open("a") as log:
            self.process = subprocess.Popen(
                ["timeout", str(RUN_SECONDS), "./run_train.sh", *args, "--job.dump_folder", str(run_dir)],
                cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def poll(self) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        text = path.read_text()
        now = time.monotonic()
        complete = text[self._read: text.rfind("\n") + 1]
        self._read += len(complete)
        self.steps += [(now, json.loads(line)) for line in complete.splitlines()]
        lines = self.log.read_text(errors="replace").splitlines()[self._log_read:]
        self._log_read += len(lines)
        self.log_lines += [(now, line) for line in lines]

    def last_step(self) -> int:
        return self.steps[-1][1]["step"] if self.steps else 0

    def log_line_time(self, text: str) -> float | None:
        return next((t for t, line in self.log_lines if text in line), None)

    def kill(self) -> None:
        """kill -9 the launch and every process under it (torchrun's workers have sessions of their own)."""
        for pid in [*descendants(self.process.pid), self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=30)


def descendants(pid: int) -> list[int]:
    found = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return [d for child in found for d in (child, *descendants(child))]


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((e for e in environ if e.startswith(b"RANK=")), None)
    return int(rank[len("RANK="):]) if rank else None


def wait_until(condition, launches: list[Launch], what: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        for launch in launches:
            launch.poll()
            if launch.process.poll() is not None and not condition():
                raise SystemExit(f"error: a run ended before {what}; see {launch.log}")
        if time.monotonic() > deadline:
            raise SystemExit(f"error: no {what} within {seconds:.0f} s")
        time.sleep(POLL_SECONDS)


def gap_across(times: list[float], moment: float) -> float:
    """The gap between the step lines on either side of `moment`."""
    before = max((t for t in times if t <= moment), default=times[0])
    after = min((t for t in times if t > moment), default=times[-1])
    return after - before


def fault_tolerance(shape: list[str], kill_step: int, folder: Path) -> dict:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=1000)
    ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
    launches: list[Launch] = []
    try:
        survivor, victim = (Launch([*shape, *ft, "--fault_tolerance.replica_id", str(g)], folder / f"replica_{g}",
                                   **env) for g in (0, 1))
        launches += [survivor, victim]
        wait_until(lambda: min(survivor.last_step(), victim.last_step()) >= kill_step, launches, "kill step")
        victim.kill()
        killed_at = time.monotonic()
        restarted = Launch([*shape, *ft, "--fault_tolerance.replica_id", "1"], folder / "replica_1", **env)
        launches.append(restarted)
        wait_until(lambda: restarted.log_line_time("recovered live") is not None, [survivor, restarted],
                   "live recovery")
        recovered_at = restarted.log_line_time("recovered live")
        wait_until(lambda: len([t for t, _ in survivor.steps if t > recovered_at]) >= STEPS_AFTER
                   and any(r["ft/recoveries"] >= 1 for _, r in restarted.steps), [survivor, restarted],
                   "steps after the recovery")
    finally:
        for launch in launches:
            if launch.process.poll() is None:
                launch.kill()
        lighthouse.shutdown()
    times = [t for t, _ in survivor.steps]
    steps = [record["step"] for _, record in survivor.steps]
    before = [b - a for a, b in zip(times, times[1:]) if b <= killed_at][2:]  # past the first steps' warm-up
    recovery = next(r for _, r in restarted.steps if r["ft/recoveries"] >= 1)
    return {
        "median_step_s": statistics.median(before),
        "kill_to_next_step_s": min(t for t in times if t > killed_at) - killed_at,
        "gap_across_kill_s": gap_across(times, killed_at),
        "gap_across_rejoin_s": gap_across(times, recovered_at),
        "discarded_steps": int(survivor.steps[-1][1]["ft/discarded_steps"]),
        "steps_redone": len(steps) - len(set(steps)),
        "steps_without_the_lost_group": sum(r["ft/participating_groups"] < 2 for t, r in survivor.steps
                                            if t > killed_at),
        "restart_to_recovered_s": recovered_at - restarted.started,
        "state_transfer_s": recovery["ft/recovery_seconds"],
        "recovered_at_step": recovery["step"],
    }


def steps_since_restart(job: Launch) -> list[int]:
    """The steps logged since the job's step number went back (its restart from a checkpoint)."""
    steps = [record["step"] for _, record in job.steps]
    restart = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), len(steps))
    return steps[restart:]


def whole_job_restart(shape: list[str], kill_step: int, folder: Path) -> dict:
    job = Launch(shape, folder / "job", NPROC="2", MAX_RESTARTS="1")
    try:
        wait_until(lambda: job.last_step() >= kill_step, [job], "kill step")
        kill_rank_1(job)
        killed_at = time.monotonic()
        wait_until(lambda: len(steps_since_restart(job)) >= STEPS_AFTER, [job], "steps after the restart")
    finally:
        if job.process.poll() is None:
            job.kill()
    steps = [record["step"] for _, record in job.steps]
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    times = [t for t, _ in job.steps]
    before = [b - a for a, b in zip(times, times[1:]) if b <= killed_at][2:]
    return {
        "median_step_s": statistics.median(before),
        "kill_to_next_step_s": times[restart] - killed_at,
        "steps_redone": steps[restart - 1] - (steps[restart] - 1),
        "resumed_from_step": steps[restart] - 1,
    }


def kill_rank_1(job: Launch) -> bool:
    """kill -9 the worker of rank 1 (not torchrun's agent, whose environment names the rank too); False while
    torchrun is restarting the workers and there is none."""
    workers = [pid for pid in descendants(job.process.pid) if rank_of(pid) == 1]
    victim = next((pid for pid in workers if rank_of(int(Path(f"/proc/{pid}/stat").read_text().split()[3])) != 1),
                  None)
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
    return victim is not None


def goodput(launches: list[Launch], seconds: float, every: float, fail) -> dict:
    """Run `launches` for `seconds` from the first step of launches[0], calling `fail()` (True: a process was lost)
    every `every` seconds;
    the job's progress is launches[0]'s highest step and its tokens then."""
    job = launches[0]
    wait_until(lambda: job.last_step() >= 1, launches, "the first step")
    start = time.monotonic()
    failures = 0
    while time.monotonic() - start < seconds:
        if time.monotonic() - start >= every * (failures + 1) and fail():
            failures += 1
        for launch in launches:
            launch.poll()
        time.sleep(0.1)
    free = [(t, r) for t, r in job.steps if start <= t < start + every]  # the steps before the first kill
    (t0, first), (t1, last) = free[0], free[-1]
    best = max((r for _, r in job.steps), key=lambda r: r["step"])
    hours = seconds / 3600
    begin = max((r for t, r in job.steps if t <= start), key=lambda r: r["step"])
    return {
        "failures": failures,
        "steps_per_hour": (best["step"] - begin["step"]) / hours,
        "tokens_per_hour": (best["tokens_seen"] - begin["tokens_seen"]) / hours,
        "failure_free_steps_per_hour": (last["step"] - first["step"]) / (t1 - t0) * 3600,
        "failure_free_tokens_per_hour": (last["tokens_seen"] - first["tokens_seen"]) / (t1 - t0) * 3600,
    }


def goodput_both_ways(shape: list[str], folder: Path, seconds: float, every: float) -> dict:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=1000)
    ft = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
    launches: list[Launch] = []

    def lose_group_1() -> bool:
        launches[-1].kill()
        launches.append(Launch([*shape, *ft, "--fault_tolerance.replica_id", "1"], folder / "ft" / "replica_1",
                               **env))
        return True

    try:
        launches += [Launch([*shape, *ft, "--fault_tolerance.replica_id", str(g)], folder / "ft" / f"replica_{g}",
                            **env) for g in (0, 1)]
        results = {"fault_tolerance": goodput(launches, seconds, every, lose_group_1)}
    finally:
        for launch in launches:
            if launch.process.poll() is None:
                launch.kill()
        lighthouse.shutdown()
    job = Launch(shape, folder / "whole_job", NPROC="2", MAX_RESTARTS=str(int(seconds / every) + 1))
    try:
        results["whole_job_restart"] = goodput([job], seconds, every, lambda: kill_rank_1(job))
    finally:
        if job.process.poll() is None:
            job.kill()
    return results


def goodput_table(results: dict, every: float) -> str:
    lines = [f"| one process lost every {every:.0f} s | failures | steps/hour | tokens/hour | of its failure-free "
             "steps/hour | of its failure-free tokens/hour |", "|---|---|---|---|---|---|"]
    for name, r in (("fault tolerance (2 groups x 1 process)", results["fault_tolerance"]),
                    ("whole-job restart (1 job x 2 processes, MAX_RESTARTS)", results["whole_job_restart"])):
        lines.append(f"| {name} | {r['failures']} | {r['steps_per_hour']:,.0f} | {r['tokens_per_hour']:,.0f} | "
                     f"{r['steps_per_hour'] / r['failure_free_steps_per_hour']:.0%} | "
                     f"{r['tokens_per_hour'] / r['failure_free_tokens_per_hour']:.0%} |")
    return "\n".join(lines)


def table(ft: dict, job: dict) -> str:
    rows = [
        ("median step before the kill (s)", f"{ft['median_step_s']:.2f}", f"{job['median_step_s']:.2f}"),
        ("kill to the next committed step (s)", f"{ft['kill_to_next_step_s']:.2f} (the survivor)",
         f"{job['kill_to_next_step_s']:.2f} (restarted job)"),
        ("survivor's gap across the kill / the rejoin (s)",
         f"{ft['gap_across_kill_s']:.2f} / {ft['gap_across_rejoin_s']:.2f}", "-"),
        ("steps discarded", str(ft["discarded_steps"]), "-"),
        ("steps trained without the lost process's samples", str(ft["steps_without_the_lost_group"]), "0"),
        ("steps done again", str(ft["steps_redone"]),
         f"{job['steps_redone']} (resumed from step {job['resumed_from_step']})"),
        ("restarted process back in the job (s)",
         f"{ft['restart_to_recovered_s']:.2f} (live at step {ft['recovered_at_step']}; transfer "
         f"{ft['state_transfer_s']:.2f})", f"{job['kill_to_next_step_s']:.2f} (the whole job)"),
    ]
    lines = ["| | fault tolerance (2 groups x 1 process) | whole-job restart (1 job x 2 processes) |",
             "|---|---|---|"]
    return "\n".join(lines + [f"| {name} | {a} | {b} |" for name, a, b in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000,
                        help="training.steps of the runs, which are stopped once measured: only a bound")
    parser.add_argument("--kill_step", type=int, default=25, help="kill -9 one process right after this step")
    parser.add_argument("--checkpoint_interval", type=int, default=10)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--local_batch_size", type=int, default=4, help="per group (fault tolerance) or per rank")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--goodput_seconds", type=float, default=0,
                        help="measure goodput for this long each way instead (0: the single failure)")
    parser.add_argument("--failure_every", type=float, default=30, help="goodput: seconds between two kills")
    args = parser.parse_args()
    if not 3 < args.kill_step < args.steps:
        parser.error(f"--kill_step must be in (3, --steps = {args.steps}): steps before it give the median step")
    if args.kill_step % args.checkpoint_interval == 0 or args.checkpoint_interval > args.kill_step:
        parser.error("--kill_step must fall after a checkpoint and not on one (a multiple of --checkpoint_interval "
                     "below it, not equal)")
    steps = 10**6 if args.goodput_seconds else args.steps  # goodput runs are stopped after their time
    shape = ["--training.steps", str(steps), "--training.dataset", "synthetic", "--model.tokenizer", "byte",
             "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.local_batch_size),
             "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--checkpoint.enable",
             "--checkpoint.interval", str(args.checkpoint_interval)]
    if args.goodput_seconds:
        with tempfile.TemporaryDirectory(prefix="bench_ft_") as folder:
            results = goodput_both_ways(shape, Path(folder), args.goodput_seconds, args.failure_every)
        print(json.dumps(results, indent=2) if args.json else goodput_table(results, args.failure_every))
        return
    with tempfile.TemporaryDirectory(prefix="bench_ft_") as folder:
        ft = fault_tolerance(shape, args.kill_step, Path(folder) / "ft")
        job = whole_job_restart(shape, args.kill_step, Path(folder) / "whole_job")
    if args.json:
        print(json.dumps({"fault_tolerance": ft, "whole_job_restart": job}, indent=2))
    else:
        print(table(ft, job))


if __name__ == "__main__":
    main()
