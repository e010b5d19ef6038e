"""dtrain initialises every weight from the distribution torchtitan 0.2.2 does (not bit for bit).

torchtitan's model of a flavor is built and initialised by its own code in a subprocess (torchtitan_models.py),
dtrain's of the same flavor here, both after torch.manual_seed(0). Per parameter: the same names and shapes, sample
mean and std that agree within sampling error, extremes that agree, and on both sides the distribution the name
calls for, truncation included:
- embedding: std 1, untruncated (unless tied: then it is the head);
- head: std dim**-0.5, truncated at exactly 3 std (so the largest of 500k draws sits just inside the bound);
- everything else: std 0.02 into attention and the FFNs, 0.02 / sqrt(2 (layer + 1)) out of them and for the
  router's gate, truncated only at +-2 (so the largest of 16k+ draws lies well beyond 3 std);
- norms: ones.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from test_torchtitan_flavors import torchtitan_run
from torchtitan_models import param_stats

from dtrain.parallelize import get_family

pytestmark = pytest.mark.slow  # each case starts torchtitan in a subprocess

# family, flavor, torchtitan's overrides, dtrain's same overrides (fewer layers and experts keep the MoE small).
CASES = {
    "llama3": ("llama3", "debugmodel", {}, {}),
    "qwen3_tied": ("qwen3", "debugmodel", {}, {}),
    "qwen3_moe": ("qwen3", "debugmodel_moe", {"n_layers": 2, "moe_args.num_experts": 8},
                  {"n_layers": 2, "moe_num_experts": 8}),
    "deepseek_v3": ("deepseek_v3", "debugmodel", {}, {}),
}
IN_PROJECTIONS = {"wq", "wk", "wv", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1"}
OUT_PROJECTIONS = {"wo", "w2", "w3", "gate"}
# The std of a normal truncated at 3 std, relative to the untruncated one.
STD_TRUNCATED_AT_3 = 0.98654
# Enough draws that an untruncated normal's largest one lies beyond 3.3 std but for a chance of 1e-7.
MANY = 16384


def expected(name: str, dim: int, tied: bool) -> tuple[float, float | None] | None:
    """(std, truncation bound) that `name`'s weight is drawn with; None: ones."""
    leaf = [part for part in name.split(".") if part != "weight"][-1]
    if leaf.endswith("norm"):
        return None
    if name == "output.weight" or (tied and name == "tok_embeddings.weight"):
        return dim**-0.5, 3 * dim**-0.5
    if name == "tok_embeddings.weight":
        return 1.0, None
    layer = int(name.split(".")[1])
    if leaf in IN_PROJECTIONS:
        return 0.02, 2.0
    assert leaf in OUT_PROJECTIONS, name
    return 0.02 / math.sqrt(2 * (layer + 1)), 2.0


def check_distribution(side: str, name: str, stats: dict, law: tuple[float, float | None] | None) -> None:
    n = math.prod(stats["shape"])
    assert stats["clamped"] <= 2, (side, name, stats)  # erfinv(-1) draws: about n / 2**24 expected
    if law is None:
        assert stats["min"] == stats["max"] == 1.0, (side, name, stats)
        return
    std, bound = law
    sample_std = std * (STD_TRUNCATED_AT_3 if bound is not None and bound <= 3 * std else 1.0)
    assert abs(stats["std"] / sample_std - 1) < 6 / math.sqrt(2 * n), (side, name, stats, std)
    assert abs(stats["mean"]) < 6 * std / math.sqrt(n), (side, name, stats, std)
    extreme = max(-stats["min"], stats["max"])
    if bound is not None:
        assert extreme <= bound * (1 + 1e-6), (side, name, stats, bound)
    if n >= MANY:
        if bound is not None and bound <= 3 * std:
            assert extreme > 0.96 * bound, (side, name, stats, bound)  # cut at the bound, not below it
        else:
            assert extreme > 3.3 * std, (side, name, stats, std)  # not cut at 3 std


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_weight_is_drawn_as_torchtitan_draws_it(tmp_path, case):
    family, flavor, their_overrides, our_overrides = CASES[case]
    theirs = torchtitan_run(family, tmp_path / "init.json", flavor, json.dumps(their_overrides))["init"]
    spec = get_family(family).model
    args = replace(spec.flavors[flavor], **our_overrides)
    torch.manual_seed(0)
    ours = param_stats(spec.model_cls(args))  # built on the CPU, so initialised by its constructor

    assert sorted(ours) == sorted(theirs)
    for name, mine in ours.items():
        their = theirs[name]
        assert mine["shape"] == their["shape"], name
        law = expected(name, args.dim, args.tie_word_embeddings)
        check_distribution("torchtitan", name, their, law)
        check_distribution("dtrain", name, mine, law)
        n = math.prod(mine["shape"])
        scale = max(mine["std"], their["std"])
        assert abs(mine["std"] - their["std"]) <= 6 * scale / math.sqrt(n), (name, mine, their)
        assert abs(mine["mean"] - their["mean"]) <= 6 * scale * math.sqrt(2 / n), (name, mine, their)
        if n >= 1000:
            for end in ("min", "max"):
                assert abs(mine[end] - their[end]) <= 1.5 * scale, (name, end, mine, their)
