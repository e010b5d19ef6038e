"""dtrain's preference tuning gives TRL's numbers: the same tiny random Llama (a transformers folder), the same
pairs in the same order, the same optimizer and schedule; per step the loss, rewards, accuracies, margins and
log-probabilities within 1e-5 (fp32), for DPO (TRL's DPOTrainer, the reference passed as ref_model) and SimPO
(TRL's CPOTrainer with loss_type = simpo, reference-free). Measured here: about 1e-7 (DPO) and 1e-6 (SimPO).
ORPO's odds-ratio term is compared with TRL's ORPOTrainer.odds_ratio_loss itself.

Where the two differ (docs/preference-tuning.md, "Against TRL"): CPOTrainer's logits/* is the mean of every logit
of the chosen rows, prompt and padding included, where dtrain (and DPOTrainer) average over the answers' tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dtrain.config.preference import Preference
from dtrain.preference.losses import pair_losses
from test_preference_losses import SCORES

from trl_runs import dtrain_run, trl_run, write_model, write_pairs

pytestmark = [pytest.mark.slow]

TOLERANCE = 1e-5
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    return write_model(root / "model"), write_pairs(root / "pairs.jsonl"), root


def assert_same_steps(ours: list[dict], theirs: list[dict], keys: tuple[str, ...]) -> None:
    assert len(ours) == len(theirs)
    for step, (mine, trl) in enumerate(zip(ours, theirs), start=1):
        for key in keys:
            assert mine[key] == pytest.approx(float(trl[key]), abs=TOLERANCE), f"step {step} {key}"


def test_dpo_matches_trl_dpo_trainer(folders):
    model, pairs, root = folders
    theirs = trl_run(model, root / "trl_dpo", "sigmoid", beta=0.1)
    ours = dtrain_run(model, pairs, root / "dtrain_dpo", "sigmoid", "--training.preference.beta", "0.1")
    assert_same_steps(ours, theirs, (*COMPARED, "logits/chosen", "logits/rejected"))
    assert len({round(step["loss"], 6) for step in ours}) == len(ours)  # it trains: no two steps alike


def test_simpo_matches_trl_cpo_trainer(folders):
    model, pairs, root = folders
    theirs = trl_run(model, root / "trl_simpo", "simpo", beta=2.0, simpo_gamma=0.5)
    ours = dtrain_run(model, pairs, root / "dtrain_simpo", "simpo", "--training.preference.beta", "2.0",
                      "--training.preference.simpo_gamma", "0.5")
    assert_same_steps(ours, theirs, COMPARED)
    # CPOTrainer's logits/* averages the prompt's and the padding's logits too: not the answers' mean.
    assert ours[0]["logits/chosen"] != pytest.approx(float(theirs[0]["logits/chosen"]), abs=TOLERANCE)


def test_orpo_is_trl_orpo_trainers_odds_ratio_loss_plus_the_nll_per_pair():
    from trl.experimental.orpo import ORPOTrainer

    settings = Preference(loss="orpo", beta=0.2)
    ours = pair_losses(SCORES, settings)
    chosen, rejected = SCORES.chosen_mean, SCORES.rejected_mean
    trainer = SimpleNamespace(beta=0.2, accelerator=SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(trainer, chosen, rejected)
    # ORPOTrainer: its NLL (the chosen answers' mean token NLL over the batch) minus beta * log sigmoid(log odds);
    # dtrain takes the NLL per pair (the same for answers of equal length, and on one pair per step).
    torch.testing.assert_close(ours.loss, -chosen - losses)
    torch.testing.assert_close(ours.chosen_reward, chosen_rewards)
    torch.testing.assert_close(ours.rejected_reward, rejected_rewards)
