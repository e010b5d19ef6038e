"""[eval] in a training run: the pre-flight check of its tasks, and the hooks that evaluate the training model.

main.py hands `add_eval_hooks` to the run (run/ sits below eval and never imports it). The hooks come after the
checkpoint's, so that an evaluation at a saving step finds that step's checkpoint folder and writes the harness's
results JSON into it (else into <run>/eval/step-N). The model is evaluated as it trains (its sharded parts, in eval
mode without gradients; run/validation.py's `evaluating` restores mode and buffers afterwards).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from dtrain.config.evaluation import limit_value
from dtrain.config.schema import JobConfig
from dtrain.eval.tasks import ResolvedTasks, resolve_tasks
from dtrain.metrics import MetricsLogger
from dtrain.run.hooks import Hooks, StepEnd
from dtrain.run.validation import evaluating
from dtrain.step.state import TrainState

logger = logging.getLogger("dtrain")


def check_eval_tasks(cfg: JobConfig) -> ResolvedTasks | None:
    """[eval]'s tasks, resolved before training: an unknown name or missing data ends the run in one line."""
    if not cfg.eval.enable:
        return None
    return resolve_tasks(cfg.eval.tasks, cfg.eval.task_paths)


def add_eval_hooks(
    cfg: JobConfig, tasks: ResolvedTasks, tokenizer, max_length: int, hooks: Hooks, state: TrainState,
    metrics: MetricsLogger, run_dir: Path,
) -> None:
    """Evaluate every `eval.every` steps and after the last step (`eval.at_end`), once per step, with the run's
    `tokenizer` and context (`max_length`, the model's max_seq_len)."""
    from dtrain.eval.backend import DtrainLM
    from dtrain.eval.evaluate import Evaluation, evaluate, task_metrics, write_results

    e = cfg.eval
    evaluation = Evaluation(
        tasks, num_fewshot=None if e.num_fewshot < 0 else e.num_fewshot, limit=limit_value(e.limit),
        log_samples=e.log_samples, bootstrap_iters=e.bootstrap_iters,
    )
    done: set[int] = set()

    def run(step: int) -> None:
        if step in done:
            return
        done.add(step)
        model = state.model_parts[0]
        device = next(model.parameters()).device
        with evaluating(state.model_parts):
            lm = DtrainLM(model, tokenizer, max_length, device, batch_size=e.batch_size, max_gen_toks=e.max_gen_toks,
                          seed=cfg.debug.seed)
            results, seconds = evaluate(lm, evaluation)
        metrics.log_validation(step, task_metrics(results), seconds=seconds)
        if not dist.is_initialized() or dist.get_rank() == 0:
            step_folder = run_dir / cfg.checkpoint.folder / f"step-{step}"
            written = write_results(results, step_folder if step_folder.is_dir() else run_dir / "eval" / f"step-{step}")
            logger.info("eval: step %d, %s in %.1f s; results in %s", step, ", ".join(results["results"]), seconds,
                        written)

    def after_step(end: StepEnd) -> None:
        if not end.preempted:  # a preempted run saves and stops: the evaluation waits for the resumed run
            run(end.step)

    if e.every:
        hooks.add(after_step, every=e.every)
    if e.at_end:  # at the end of training, not of a run stopped early by a preemption signal
        hooks.at_end(lambda: state.step == cfg.training.steps and run(state.step))
