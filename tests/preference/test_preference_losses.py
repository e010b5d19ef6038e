"""The losses' formulas, and where they differ from TRL 1.16 (docs/preference-tuning.md, "Against TRL")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtrain.config.preference import Preference
from dtrain.preference.losses import Scores, pair_losses

# Three pairs of summed log-probabilities, their reference's and the answers' token counts.
SCORES = Scores(
    chosen=torch.tensor([-12.0, -30.0, -8.0]), rejected=torch.tensor([-14.0, -25.0, -9.5]),
    chosen_tokens=torch.tensor([4, 10, 2]), rejected_tokens=torch.tensor([5, 8, 3]),
    reference_chosen=torch.tensor([-13.0, -29.0, -8.5]), reference_rejected=torch.tensor([-13.5, -26.0, -9.0]),
)


def test_label_smoothing_is_conservative_dpo():
    # TRL 1.16's DPOTrainer reads label_smoothing only in its robust, exo_pair and aot losses (its sigmoid ignores
    # it); dtrain's sigmoid with label smoothing is conservative DPO, TRL's sigmoid of earlier releases.
    logits = 0.1 * ((SCORES.chosen - SCORES.reference_chosen) - (SCORES.rejected - SCORES.reference_rejected))
    smoothed = pair_losses(SCORES, Preference(beta=0.1, label_smoothing=0.2)).loss
    torch.testing.assert_close(smoothed, -0.8 * F.logsigmoid(logits) - 0.2 * F.logsigmoid(-logits))
    torch.testing.assert_close(pair_losses(SCORES, Preference(beta=0.1)).loss, -F.logsigmoid(logits))


def test_ipo_averages_the_log_ratios_over_answer_tokens_as_trl_does():
    chosen = (SCORES.chosen - SCORES.reference_chosen) / SCORES.chosen_tokens
    rejected = (SCORES.rejected - SCORES.reference_rejected) / SCORES.rejected_tokens
    ipo = pair_losses(SCORES, Preference(loss="ipo", beta=0.5))
    torch.testing.assert_close(ipo.loss, (chosen - rejected - 1.0) ** 2)


def test_the_sft_weight_adds_the_chosen_answers_mean_token_nll():
    plain, rpo = pair_losses(SCORES, Preference()), pair_losses(SCORES, Preference(sft_weight=0.5))
    torch.testing.assert_close(rpo.loss, plain.loss + 0.5 * -SCORES.chosen / SCORES.chosen_tokens)
