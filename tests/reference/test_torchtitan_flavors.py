"""Every flavor torchtitan 0.2.2 defines for Llama 3, Qwen3 (dense and MoE) and DeepSeek-V3 is dtrain's flavor of
that name, field for field: torchtitan's args (read by its own code, torchtitan_models.py) are translated into
dtrain's fields, and every dtrain field but max_seq_len is compared.

max_seq_len is the run's in both projects: torchtitan's update_from_config sets it to training.seq_len, dtrain to
at least that. It decides one thing beyond the RoPE table's length, DeepSeek's YaRN, which torchtitan applies only
when max_seq_len exceeds original_seq_len; dtrain's DeepSeek flavors hold that original length, so the same
seq_len switches YaRN on in both.

Each translation also accounts for every torchtitan field it does not translate: a value dtrain always computes
with (checked), or a setting that is not the model's in dtrain (the attention kernel, the document mask).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from reference_scripts import run_reference_script
import torch

from dtrain.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, DeepSeekV3Transformer
from dtrain.models.deepseek_v3.yarn import YarnScaling
from dtrain.models.llama3 import LLAMA3_FLAVORS, Llama3Args, RopeScaling
from dtrain.models.qwen3 import QWEN3_FLAVORS, Qwen3Args

pytestmark = pytest.mark.slow  # each case starts torchtitan in a subprocess

SCRIPT = Path(__file__).with_name("torchtitan_models.py")
FLAVORS = {"llama3": (LLAMA3_FLAVORS, Llama3Args), "qwen3": (QWEN3_FLAVORS, Qwen3Args),
           "deepseek_v3": (DEEPSEEK_V3_FLAVORS, DeepSeekV3Args)}
# torchtitan fields that are no model arg in dtrain: the kernel (sdpa, flex, varlen: the same function) and the
# mask (block_causal is dtrain's training.attention_mask), the token that ends a document for that mask, an
# inference batch bound, and how experts and their communication are computed.
RUN_SETTINGS = {"_enforced", "max_seq_len", "attn_type", "attn_mask_type", "eos_id", "max_batch_size",
                "expert_parallel_comm_backend", "use_grouped_mm", "_debug_force_load_balance"}


def torchtitan_run(family: str, out: Path, *init: str) -> dict:
    run_reference_script(SCRIPT.name, family, out, *init, cwd=SCRIPT.parent)
    return json.loads(out.read_text())


class Translation:
    """dtrain's field values from one torchtitan flavor's args, remembering which of its fields were read."""

    def __init__(self, tt: dict):
        self.tt, self.fields, self.read = tt, {}, set(RUN_SETTINGS)

    def get(self, name: str):
        self.read.add(name)
        return self.tt[name]

    def copy(self, ours: str, theirs: str | None = None) -> None:
        self.fields[ours] = self.get(theirs or ours)

    def expect(self, name: str, value) -> None:
        """A torchtitan field that dtrain always computes with as `value`."""
        assert self.get(name) == value, (name, self.tt[name])

    def done(self) -> dict:
        assert set(self.tt) <= self.read, f"torchtitan fields not accounted for: {set(self.tt) - self.read}"
        return self.fields


def _check_moe_always(moe: dict) -> None:
    # dtrain weights the experts' outputs by the scores (after the experts), and its gate has no bias.
    assert (moe["score_before_experts"], moe["gate_bias"], moe["_debug_force_load_balance"]) == (False, False, False)


def llama3_fields(tt: dict) -> dict:
    t = Translation(tt)
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier", "norm_eps",
                 "rope_theta"):
        t.copy(name)
    kv_heads = t.get("n_kv_heads")
    t.fields["n_kv_heads"] = kv_heads if kv_heads is not None else tt["n_heads"]  # None: multi-head attention
    # torchtitan applies these to every Llama 3 flavor.
    scaling = t.get("rope_scaling_args")
    t.fields["rope_scaling"] = RopeScaling(
        factor=scaling["scaling_factor"], low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
    )
    t.fields["tie_word_embeddings"] = False  # torchtitan's Llama 3 has no tying
    t.expect("depth_init", True)  # dtrain's init is always depth-scaled
    return t.done()


def qwen3_fields(tt: dict) -> dict:
    t = Translation(tt)
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "vocab_size", "norm_eps",
                 "rope_theta"):
        t.copy(name)
    t.copy("tie_word_embeddings", "enable_weight_tying")
    t.expect("qk_norm", True)  # dtrain's Qwen3 always has QK-norm ...
    t.expect("depth_init", True)  # ... and a depth-scaled init
    t.fields.update(moe_num_experts=0, moe_top_k=None, moe_hidden_dim=None, moe_route_norm=None,
                    moe_aux_loss_coeff=None, moe_load_balance_bias=None)
    moe, moe_hidden_dim = t.get("moe_args"), t.get("moe_inter_dim")
    if t.get("moe_enabled"):
        _check_moe_always(moe)
        assert (moe["num_shared_experts"], moe["score_func"], moe["route_scale"]) == (0, "softmax", 1.0)
        assert moe["num_expert_groups"] is None and moe["num_limited_groups"] is None
        # No auxiliary loss in torchtitan 0.2.2, and its Qwen3 optimizers never update the expert bias that
        # load_balance_coeff gives the layer: it stays zero, routing as none.
        t.fields.update(moe_num_experts=moe["num_experts"], moe_top_k=moe["top_k"], moe_hidden_dim=moe_hidden_dim,
                        moe_route_norm=moe["route_norm"], moe_aux_loss_coeff=0.0, moe_load_balance_bias=False)
    return t.done()


def deepseek_v3_fields(tt: dict) -> dict:
    t = Translation(tt)
    for name in ("dim", "n_layers", "n_dense_layers", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "vocab_size", "norm_eps", "rope_theta"):
        t.copy(name)
    t.copy("hidden_dim", "inter_dim")
    t.copy("moe_hidden_dim", "moe_inter_dim")
    # Its q_norm and kv_norm take norm_eps; its final norm is nn.RMSNorm(dim), without one.
    t.fields.update(latent_norm_eps=tt["norm_eps"], final_norm_dtype_eps=True, tie_word_embeddings=False)
    # Its softmax scale takes mscale squared and its frequencies no factor: HF's rule with mscale == mscale_all_dim.
    t.fields["rope_scaling"] = YarnScaling(
        factor=t.get("rope_factor"), original_max_position_embeddings=t.get("original_seq_len"),
        beta_fast=t.get("beta_fast"), beta_slow=t.get("beta_slow"), mscale=t.get("mscale"),
        mscale_all_dim=tt["mscale"],
    )
    t.fields["rope_scaling_beyond_original_only"] = True
    moe = t.get("moe_args")
    _check_moe_always(moe)
    coeff = moe["load_balance_coeff"]
    t.fields.update(
        moe_num_experts=moe["num_experts"], moe_top_k=moe["top_k"], moe_num_shared_experts=moe["num_shared_experts"],
        moe_score_func=moe["score_func"], moe_route_norm=moe["route_norm"], moe_route_scale=moe["route_scale"],
        moe_num_expert_groups=moe["num_expert_groups"] or 1, moe_num_limited_groups=moe["num_limited_groups"] or 1,
        # Loss-free balancing (its DeepSeek-V3 optimizers move the bias by load_balance_coeff each step), no
        # auxiliary loss.
        moe_aux_loss_coeff=0.0, moe_load_balance_bias=coeff is not None,
        moe_bias_update_speed=coeff if coeff is not None else DeepSeekV3Args.moe_bias_update_speed,
    )
    return t.done()


TRANSLATE = {"llama3": llama3_fields, "qwen3": qwen3_fields, "deepseek_v3": deepseek_v3_fields}


@pytest.mark.parametrize("family", sorted(FLAVORS))
def test_every_torchtitan_flavor_is_dtrains_field_for_field(tmp_path, family):
    ours, args_cls = FLAVORS[family]
    theirs = torchtitan_run(family, tmp_path / "flavors.json")["flavors"]
    compared = {f.name for f in dataclasses.fields(args_cls)} - {"max_seq_len"}
    for name, tt in theirs.items():
        assert name in ours, f"torchtitan's {family} flavor {name!r} is missing"
        expected = TRANSLATE[family](tt)
        assert set(expected) == compared, compared ^ set(expected)  # a new dtrain field must be compared too
        actual = {field: getattr(ours[name], field) for field in expected}
        assert actual == expected, (name, {k: (actual[k], v) for k, v in expected.items() if actual[k] != v})
        if family == "deepseek_v3":
            # YaRN switches on at the same run length: beyond the original context in both.
            assert ours[name].max_seq_len == tt["original_seq_len"]
            assert ours[name].active_rope_scaling is None
            longer = dataclasses.replace(ours[name], max_seq_len=tt["original_seq_len"] + 1)
            assert longer.active_rope_scaling == expected["rope_scaling"]


@pytest.mark.parametrize("max_seq_len", [4096, 8192], ids=["plain_rope", "yarn"])
def test_deepseek_debugmodel_computes_torchtitans_logits(tmp_path, max_seq_len):
    """What torchtitan's DeepSeek-V3 forward reads beyond the shapes (the norms' eps: block, latent and final;
    YaRN and the length it starts at; the softmax scale; softmax routing with shared experts) gives its logits
    from its own weights."""
    overrides = {"max_seq_len": max_seq_len}
    torchtitan_run("deepseek_v3", tmp_path / "forward.json", "debugmodel", json.dumps(overrides), "--forward")
    saved = torch.load(tmp_path / "forward.pt")
    (tmp_path / "forward.pt").unlink()  # 130 MB of weights
    args = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel"], max_seq_len=max_seq_len)
    assert (args.active_rope_scaling is None) == (max_seq_len <= 4096)
    model = DeepSeekV3Transformer(args)
    model.load_state_dict(saved["state_dict"])  # the same names, expert_bias included
    with torch.no_grad():
        logits = model(saved["tokens"])
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)
