"""Every command block of README.md and docs/*.md runs as written, page by page, in a scratch clone.

Each block has one check below, found by its page and the start of its first command; a block without a check, or
a check without its block, fails `test_every_command_block_has_a_check`, so a doc cannot gain or change a command
that no test runs. A check runs the block's commands in order, as a user's shell would, with only these changes:
- a training run is shortened by flags appended to its command line (`--training.steps 2`: later flags win);
- what needs a GPU, a cluster or an 8B model's assets is checked as far as this machine goes: `--job.print_config`
  appended (the config loads with its keys, types, choices and bounds checked), `--dry_run` for compile_study.py,
  the estimator as written, and the one-line error a user without the assets gets (downloads run with
  HF_HUB_OFFLINE=1);
- placeholder paths become real ones in the scratch clone: `/models/<name>` is a tiny random model that
  transformers writes into its `hf_models/<name>` (its `models/` is dtrain's package), `step-1000` / `step-40`
  the checkpoint the shortened run saved, and torchtitan's `path/to/...` files are copies of torchtitan 0.2.2's
  own TOML files.
docs/first-day.md runs in tests/e2e/test_first_day.py, which checks each of its steps' outcome.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
from doc_pages import (
    Block,
    Checkout,
    checked_config,
    command_blocks,
    environment_has,
    hf_generation,
    newest_step,
    run_python,
    run_train_with,
    tiny_hf_model,
    with_models,
)
from run_train_helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.torch_independent]

SHORT = ("--training.steps", "2")
TORCHTITAN_TOMLS = REPO / "tests" / "config" / "torchtitan_v0_2_2"

Check = Callable[[Checkout, list[str]], None]
CHECKS: dict[tuple[str, str], Check] = {}


def check(page: str, start: str) -> Callable[[Check], Check]:
    def register(function: Check) -> Check:
        CHECKS[(page, start)] = function
        return function

    return register


def commands(block: Block) -> list[str]:
    """The block's commands (or, for Python, its whole text as one), continuation lines joined, comments dropped."""
    if block.language == "python":
        return [block.text]
    joined = block.text.replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def check_key(block: Block) -> tuple[str, str] | None:
    """The check of `block`: the one of its page whose start matches most of its first command."""
    found = [(page, start) for page, start in CHECKS if page == block.page and block.key.startswith(start)]
    return max(found, key=lambda key: len(key[1]), default=None)


@check("README.md", "./run_train.sh               # train")
def readme_quick_start(checkout: Checkout, lines: list[str]) -> None:
    train, quick, whole = lines
    assert "training done" in checkout.ok(run_train_with(train, *SHORT))
    assert re.search(r"\d+ tests collected", checkout.ok(quick + " --collect-only -q"))
    assert whole in (REPO / ".ci" / "run").read_text().splitlines()  # CI runs the whole suite so


@check("README.md", "./run_train.sh --config llama3_8b --training.steps 10")
def readme_configs(checkout: Checkout, lines: list[str]) -> None:
    llama3_8b, help_, print_config = lines
    assert 'flavor = "8B"' in checked_config(checkout, llama3_8b)
    assert "--training.steps" in checkout.ok(help_)
    assert "[training]" in checkout.ok(print_config)


@check("README.md", "./run_train.sh --checkpoint.enable")
def readme_generation(checkout: Checkout, lines: list[str]) -> None:
    train, generate, generate_hf = lines
    assert "training done" in checkout.ok(run_train_with(train, *SHORT))
    generated = checkout.ok(generate)
    assert "ids: " in generated and "text: " in generated
    hf_generation(checkout, generate_hf)


@check("docs/benchmarks.md", "python scripts/compile_study.py --config debug_model --modes default,max-autotune")
@check("docs/profiling.md", "python scripts/compile_study.py --config debug_model --steps 10 --cache")
@check("docs/profiling.md", "python scripts/compile_study.py --config llama3_8b")
def compile_study(checkout: Checkout, lines: list[str]) -> None:
    (study,) = lines
    planned = checkout.ok(study + " --dry_run")
    assert planned.startswith("eager: ") and "compile default" in planned


# docs/checkpointing.md
@check("docs/checkpointing.md", "import torch")
def checkpoint_to_torch_save(checkout: Checkout, lines: list[str]) -> None:
    # The page's setting: the last save holds the weights only.
    checkout.ok(run_train_with("./run_train.sh --checkpoint.enable --checkpoint.last_save_model_only "
                               "--job.dump_folder outputs/run", *SHORT))
    step = newest_step(checkout.root / "outputs" / "run")
    run_python(checkout, lines[0].replace("step-1000", f"step-{step}") + "assert 'tok_embeddings.weight' in weights\n")


@check("docs/checkpointing.md", "NPROC=1 ./run_train.sh --config llama3_8b --checkpoint.create_seed_checkpoint")
def seed_checkpoint(checkout: Checkout, lines: list[str]) -> None:
    seed, train = lines
    assert "create_seed_checkpoint = true" in checked_config(checkout, seed)
    checked_config(checkout, train)


@check("docs/checkpointing.md", "python scripts/convert_checkpoint.py to-hf")
def convert_checkpoints(checkout: Checkout, lines: list[str]) -> None:
    to_hf, from_hf, train_from_hf = lines
    step = newest_step(checkout.root / "outputs" / "run")  # written by the page's first block
    checkout.ok(to_hf.replace("step-1000", f"step-{step}"))
    assert (checkout.root / "hf_out" / "config.json").is_file()
    tiny_hf_model(checkout.root / "hf_models" / "Llama-3.1-8B", "llama3")
    checkout.ok(with_models(from_hf, checkout))
    assert (checkout.root / "dcp_out").is_dir()
    assert "initial_load_in_hf = true" in checked_config(checkout, with_models(train_from_hf, checkout))


@check("docs/checkpointing.md", "from dtrain.checkpoint import CheckpointManager")
def checkpoint_api_sketch(checkout: Checkout, lines: list[str]) -> None:
    # A sketch of the loop's use of the API, with the loop's own variables: its imports and calls' names must exist.
    imports = [line for line in lines[0].splitlines() if line.startswith("from ")]
    run_python(checkout, "\n".join(imports) + "\nassert CheckpointManager.restore_at_startup and "
               "CheckpointManager.maybe_save and PreemptionWatcher.should_stop\n")


# docs/cluster.md: each launch's config for its world, the scripts it names present.
@check("docs/cluster.md", "NNODES=2 NPROC=8 RDZV_ENDPOINT=node-a:29500")
def multi_node(checkout: Checkout, lines: list[str]) -> None:
    for launch in lines:
        checked_config(checkout, launch)


@check("docs/cluster.md", "./scripts/setup_env.sh   # once, on the login node: builds")
@check("docs/cluster.md", "./scripts/setup_env.sh   # once, on the login node")
def slurm(checkout: Checkout, lines: list[str]) -> None:
    setup, *launches = lines
    assert "Python environment ready" in checkout.ok(setup)
    for launch in launches:
        if launch.startswith("salloc "):
            continue  # an interactive allocation: nothing to check without SLURM
        script, _, args = re.search(r"(scripts/slurm/\S+)( (.*))?$", launch).groups()
        assert (checkout.root / script).is_file(), script
        checked_config(checkout, f"./run_train.sh {args}")


@check("docs/collectives.md", "NPROC=4 ./scripts/comm_bench.sh")
def comm_bench(checkout: Checkout, lines: list[str]) -> None:
    four, eight, _across_nodes = lines  # the last needs two machines
    for bench in (four, eight):
        assert "| all_reduce |" in checkout.ok(bench + " --sizes 4K --iters 2 --warmup 1")
    assert (checkout.root / "out.json").is_file()


@check("docs/configuration.md", "from dtrain.config import load_config")
@check("docs/data.md", "from dtrain.config import load_config")
def python_api(checkout: Checkout, lines: list[str]) -> None:
    run_python(checkout, lines[0])


# docs/data.md: downloads end in one line without the network; the assets, built here, then work as written.
@check("docs/data.md", "python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B")
def hf_assets(checkout: Checkout, lines: list[str]) -> None:
    download, train = lines
    assert "error: cannot download from meta-llama/Llama-3.1-8B" in checkout.one_error_line(download, 1)
    assert "Llama-3.1-8B" in checkout.one_error_line(run_train_with(train, *SHORT), 2)
    tiny_hf_model(checkout.root / "assets" / "hf" / "Llama-3.1-8B", "llama3")
    assert "training done" in checkout.ok(run_train_with(train, *SHORT))


@check("docs/data.md", "python scripts/download_hf_assets.py --dataset c4")
def c4(checkout: Checkout, lines: list[str]) -> None:
    download, train = lines
    assert "error: cannot download from allenai/c4" in checkout.one_error_line(download, 1)
    assert "download_hf_assets.py --dataset c4" in checkout.one_error_line(run_train_with(train, *SHORT), 2)


def write_corpus(folder: Path) -> None:
    folder.mkdir()
    for index in range(8):
        (folder / f"doc{index}.txt").write_text(f"document {index}: " + "the quick brown fox jumps. " * 40)


@check("docs/data.md", "python scripts/tokenize_dataset.py --input ./my_corpus")
def tokens_dataset(checkout: Checkout, lines: list[str]) -> None:
    tokenize, train = lines
    write_corpus(checkout.root / "my_corpus")  # the assets are the tiny model's of the hf_assets block above
    assert "done: ./data/my_corpus holds 8 documents" in checkout.ok(tokenize)
    assert "training done" in checkout.ok(run_train_with(train, *SHORT))


@check("docs/data.md", "python scripts/tokenize_dataset.py --input ./corpus")
def tokenize_and_verify(checkout: Checkout, lines: list[str]) -> None:
    tokenize, builtin, verify = lines
    write_corpus(checkout.root / "corpus")
    checkout.ok(tokenize)
    assert "done: ./data/builtin holds" in checkout.ok(builtin)
    assert "./data/corpus: OK, 1 shard(s), 8 documents" in checkout.ok(verify)


# docs/fault-tolerance.md: scripts/ft_local.sh's launches run shortened (later flags win, in every group); the
# SLURM sketch is valid bash, and its groups' launch has a valid config.
def replica_logs(checkout: Checkout, base: str) -> list[str]:
    return [log.read_text() for log in sorted((checkout.root / base).glob("replica_*/train.log"))]


@check("docs/fault-tolerance.md", "./scripts/ft_local.sh --training.steps 200")
def ft_local(checkout: Checkout, lines: list[str]) -> None:
    two_groups, three_groups = lines
    said = checkout.ok(two_groups + " --training.steps 3", timeout=200)
    assert "replica group 0 done" in said and "replica group 1 done" in said, said[-2000:]
    logs = replica_logs(checkout, "outputs/ft")
    assert len(logs) == 2 and all("training done: 3 steps" in log for log in logs)
    assert newest_step(checkout.root / "outputs" / "ft" / "replica_1") == 3
    checkout.ok(three_groups + " --job.print_config", timeout=200)
    logs = replica_logs(checkout, "outputs/ft3")
    assert [("replica_id = %d" % g) in log and "group_size = 3" in log for g, log in enumerate(logs)] == [True] * 3


@check("docs/fault-tolerance.md", "set -euo pipefail")
def ft_slurm_sketch(checkout: Checkout, lines: list[str]) -> None:
    (checkout.root / "ft.sbatch").write_text("\n".join(lines) + "\n")
    checkout.ok("bash -n ft.sbatch")
    launch = next(re.search(r"\./run_train\.sh .*?(?= &&)", line)[0] for line in lines if "run_train.sh" in line)
    printed = checked_config(checkout, "set -- --config llama3_8b; groups=4; g=3; "
                             f"export TORCHFT_LIGHTHOUSE=http://node-a:29510; {launch}")
    assert "replica_id = 3" in printed and "group_size = 4" in printed


@check("docs/fault-tolerance.md", "./scripts/ft_local.sh --fault_tolerance.semi_sync_method diloco")
def ft_semi_sync(checkout: Checkout, lines: list[str]) -> None:
    checkout.ok(lines[0] + " --training.steps 4 --fault_tolerance.sync_steps 2", timeout=200)
    assert all("training done: 4 steps" in log for log in replica_logs(checkout, "outputs/ft_diloco"))


@check("docs/benchmarks.md", "python scripts/bench_fault_tolerance.py")
def bench_fault_tolerance(checkout: Checkout, lines: list[str]) -> None:
    figures = json.loads(checkout.ok(lines[0] + " --kill_step 8 --checkpoint_interval 5 --json", timeout=280))
    assert figures["fault_tolerance"]["steps_redone"] == 0
    job = figures["whole_job_restart"]
    assert job["resumed_from_step"] == 5 and job["steps_redone"] >= 3  # killed after step 8


# docs/fine-tuning.md: the walkthrough, its runs shortened (the checkpoints then are step-2, not step-20).
def at_step_2(command: str) -> str:
    return command.replace("step-20", "step-2")


@check("docs/fine-tuning.md", "./run_train.sh --training.steps 20 --checkpoint.enable")
def fine_tuning_base(checkout: Checkout, lines: list[str]) -> None:
    assert "training done" in checkout.ok(run_train_with(lines[0], *SHORT))


@check("docs/fine-tuning.md", "./run_train.sh --config debug_chat --checkpoint.initial_load_path")
def fine_tuning_lora(checkout: Checkout, lines: list[str]) -> None:
    out = checkout.ok(run_train_with(at_step_2(lines[0]), *SHORT))
    said = "adapters loaded from outputs/chat_lora/exports/peft-step-2" if "initial_adapter_path" in lines[0] else (
        "LoRA adapters only")
    assert said in out, out[-3000:]


@check("docs/fine-tuning.md", "NPROC=2 ./run_train.sh --config debug_chat --checkpoint.initial_load_path")
def fine_tuning_qlora(checkout: Checkout, lines: list[str]) -> None:
    assert "base weights stored as NF4" in checkout.ok(run_train_with(at_step_2(lines[0]), *SHORT))


@check("docs/fine-tuning.md", "./run_generate.sh --checkpoint outputs/chat_lora")
def fine_tuning_exports(checkout: Checkout, lines: list[str]) -> None:
    generate, to_peft, to_hf = (at_step_2(line) for line in lines)
    # The chat mode in the run's template (the byte tokenizer's plain one): one turn, answered on stdout.
    said = checkout.ok(generate)
    assert "chat: plain template" in said and "prompt tokens, " in said, said[-2000:]
    checkout.ok(to_peft)
    exports = checkout.root / "outputs" / "chat_lora" / "exports"  # beside the run's checkpoints
    assert (exports / "peft-step-2" / "adapter_config.json").is_file()
    checkout.ok(to_hf)
    assert (exports / "hf-step-2" / "config.json").is_file()


@check("docs/preference-tuning.md", "./run_train.sh --config debug_dpo")
def preference_dpo(checkout: Checkout, lines: list[str]) -> None:
    out = checkout.ok(run_train_with(lines[0], *SHORT))
    assert "preference loss sigmoid, beta 0.1; the reference is a frozen copy" in out and "training done" in out
    metrics = json.loads((checkout.root / "outputs" / "debug_dpo" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"rewards/margins", "rewards/accuracies", "logps/chosen", "logits/rejected"} <= set(metrics)


@check("docs/preference-tuning.md", "./run_train.sh --config debug_dpo --lora.enable")
def preference_lora(checkout: Checkout, lines: list[str]) -> None:
    out = checkout.ok(run_train_with(lines[0], *SHORT))
    assert "the reference is the base with the LoRA adapters disabled" in out and "training done" in out


@check("docs/evaluation.md", "./run_train.sh --config debug_eval")
def evaluation_walkthrough(checkout: Checkout, lines: list[str]) -> None:
    train, evaluate = lines
    trained = checkout.ok(run_train_with(train, *SHORT))
    assert "eval/dtrain_tiny_choice/acc" in trained and "training done" in trained
    assert (checkout.root / "outputs" / "debug_eval" / "checkpoint" / "step-2" / "eval_results.json").is_file()
    evaluated = checkout.ok(evaluate)
    assert "eval/dtrain_tiny_text/word_perplexity" in evaluated and "eval/dtrain_tiny_arithmetic" in evaluated


@check("docs/evaluation.md", "./run_eval.sh --checkpoint /models/Qwen3-0.6B --hf")
def evaluation_hf(checkout: Checkout, lines: list[str]) -> None:
    if not (checkout.root / "hf_models" / "Qwen3-0.6B").exists():
        tiny_hf_model(checkout.root / "hf_models" / "Qwen3-0.6B", "qwen3")
    assert "eval/dtrain_tiny_choice/acc" in checkout.ok(with_models(lines[0], checkout))
    assert (checkout.root / "outputs" / "eval_hf" / "eval_results.json").is_file()


@check("docs/first-day.md", "")
def first_day(checkout: Checkout, lines: list[str]) -> None:
    assert "docs\" / \"first-day.md\"" in (REPO / "tests" / "e2e" / "test_first_day.py").read_text()


@check("docs/migrating-from-torchtitan.md", "./run_train.sh --config path/to/torchtitan/")
def torchtitan_tomls(checkout: Checkout, lines: list[str]) -> None:
    nested, env_var = lines
    configs = checkout.root / "path" / "to" / "torchtitan" / "models" / "llama3" / "train_configs"
    configs.mkdir(parents=True)
    shutil.copy(TORCHTITAN_TOMLS / "llama3_8b.toml", configs / "llama3_8b.toml")
    shutil.copy(TORCHTITAN_TOMLS / "llama3_8b.toml", checkout.root / "path" / "to" / "llama3_8b.toml")
    for launch in (nested, env_var):
        assert 'flavor = "8B"' in checked_config(checkout, launch)


@check("docs/models.md", "./run_generate.sh --checkpoint outputs/debug_model/checkpoint/step-40")
def generation(checkout: Checkout, lines: list[str]) -> None:
    from_step, from_run, from_hf = lines
    checkout.ok(run_train_with("./run_train.sh --checkpoint.enable", *SHORT))
    step = newest_step(checkout.root / "outputs" / "debug_model")
    assert "text: " in checkout.ok(from_step.replace("step-40", f"step-{step}"))
    assert "ids: " in checkout.ok(from_run)
    hf_generation(checkout, from_hf)


@check("docs/parallelism.md", "NPROC=2 ./run_train.sh")
def layouts(checkout: Checkout, lines: list[str]) -> None:
    for launch in lines:
        if launch.startswith("NPROC=4"):  # 4 processes on CI's 2 cores: the parity suite trains these layouts
            checked_config(checkout, launch)
        else:
            assert "training done" in checkout.ok(run_train_with(launch, "--training.steps", "1"))


@check("docs/planning.md", "python scripts/estimate.py --config llama3_405b")
@check("docs/planning.md", "python scripts/estimate.py --config llama3_8b --world_size 8 --training.local_batch_size 4")
@check("docs/planning.md", "python scripts/estimate.py --config debug_model")
def estimates(checkout: Checkout, lines: list[str]) -> None:
    for estimate in lines:
        checkout.ok(estimate)


# docs/profiling.md
@check("docs/profiling.md", "./run_train.sh --compile.enable --compile.trace_folder compile_trace --compile.debug_dir")
def compile_session(checkout: Checkout, lines: list[str]) -> None:
    (session,) = lines
    # A profiler window (3 warm-up steps and 1 active by default) in 4 steps instead of 20.
    out = checkout.ok(run_train_with(session, "--training.steps", "4", "--profiling.profile_freq", "4"))
    assert "compile: " in out and "top 8 operators" in out


def tlparse_or_its_input(checkout: Checkout, command: str) -> None:
    """tlparse where it is installed (a tool of its own: pip install tlparse); its input files otherwise."""
    if environment_has("tlparse"):
        checkout.ok(command)
    else:
        pattern = command.split()[1]
        assert list(checkout.root.glob(pattern)), f"{pattern} matches no file"


@check("docs/profiling.md", "tlparse outputs/session/")
def tlparse_session(checkout: Checkout, lines: list[str]) -> None:
    tlparse_or_its_input(checkout, lines[0])


@check("docs/profiling.md", "./run_train.sh --compile.enable --compile.trace_folder compile_trace --training.steps 3")
def compile_trace(checkout: Checkout, lines: list[str]) -> None:
    train, tlparse = lines
    checkout.ok(run_train_with(train, *SHORT))
    tlparse_or_its_input(checkout, tlparse)


@check("docs/profiling.md", "./run_train.sh --config llama3_8b --compile.enable --compile.cache")
def compile_cache_8b(checkout: Checkout, lines: list[str]) -> None:
    assert "cache = true" in checked_config(checkout, lines[0])


def test_every_command_block_has_a_check():
    blocks = command_blocks()
    unchecked = [f"{b.page}:{b.line} {b.key}" for b in blocks if check_key(b) is None]
    assert not unchecked, f"command blocks that no check runs (add one to {Path(__file__).name}): {unchecked}"
    unused = set(CHECKS) - {check_key(b) for b in blocks}
    assert not unused, f"checks whose block is gone: {sorted(unused)}"


PAGES_WITH_COMMANDS = sorted({block.page for block in command_blocks()} - {"docs/first-day.md"})


@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS)
def test_the_page_runs_as_written(tmp_path, page):
    checkout = Checkout(tmp_path / "dtrain")
    for block in [b for b in command_blocks() if b.page == page]:
        key = check_key(block)
        assert key, f"{page}:{block.line} has no check"
        CHECKS[key](checkout, commands(block))
