"""Evaluation with EleutherAI's lm-evaluation-harness on dtrain's model (the `eval` extra: lm-eval 0.4.x).

backend.py is the harness's `LM` over the model as training builds it; tasks.py finds the tasks (the bundled tiny
set in tasks/, the harness's own, a folder of the user's) and refuses unknown ones or missing data in one line;
evaluate.py runs them and writes the harness's results JSON; loading.py and cli.py serve run_eval.sh. Nothing here
is imported by the layers below (run, step, data, ...): the harness is an optional dependency.
"""
