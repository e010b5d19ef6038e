"""torchtitan's checkpoints start dtrain with torchtitan's model: torchtitan 0.2.2 builds, initialises and saves its
own Llama 3 and Qwen3 (torchtitan_checkpoint_writer.py, its CheckpointManager writing a seed checkpoint); dtrain
starts from that checkpoint through checkpoint.initial_load_path, and from the same tensors under torchtitan >= 0.3's
names, and its logits on the same ids equal torchtitan's within 1e-5 (fp32).

torchtitan 0.2.2's Qwen3 stores our names with the q/k rows in HF's RoPE order, so its checkpoint loads with
checkpoint.initial_load_writer = torchtitan and is refused without it; >= 0.3's names say who wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import make_cfg, tiny_state
from reference_scripts import run_reference_script
from torchtitan_checkpoints import save_torchtitan_names

from dtrain.checkpoint import CheckpointManager, dcp_io
from dtrain.errors import DtrainError
from dtrain.models.llama3 import Llama3Args, RopeScaling
from dtrain.models.qwen3 import Qwen3Args
from dtrain.parallelize import get_family

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is .*single process:UserWarning")
TOLERANCE = 1e-5
IDS = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))

# (torchtitan's args, ours) of one tiny model per family: GQA; Qwen3 with its tied head and head_dim apart from
# dim / n_heads; Llama 3 with RoPE scaling that moves its lowest frequencies.
SCALING = {"scaling_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
MODELS = {
    "llama3": (
        {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 320, "multiple_of": 32,
         "norm_eps": 1e-5, "rope_theta": 500000.0, "max_seq_len": 32, "rope_scaling_args": SCALING},
        Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, multiple_of=32,
                   ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=32,
                   rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=8192)),
    ),
    "qwen3": (
        {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 24, "hidden_dim": 96,
         "vocab_size": 320, "norm_eps": 1e-6, "rope_theta": 1000000.0, "max_seq_len": 32,
         "enable_weight_tying": True},
        Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=96, vocab_size=320,
                  norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32, tie_word_embeddings=True),
    ),
}


@pytest.fixture(scope="module")
def torchtitan_checkpoints(tmp_path_factory):
    """{family: ({"0.2.2": torchtitan's own checkpoint, "0.3": its tensors under >= 0.3's names}, its logits)}."""
    made = {}
    for family, (theirs, _) in MODELS.items():
        out = tmp_path_factory.mktemp(family)
        spec = json.dumps({"family": family, "args": theirs, "ids": IDS.tolist()})
        run_reference_script("torchtitan_checkpoint_writer.py", out, spec)
        seed = out / "checkpoint" / "step-0"
        save_torchtitan_names(dcp_io.read_full_weights(seed), out / "v0.3", "0.3")
        logits = torch.load(out / "logits.pt", weights_only=True)["logits"]
        made[family] = ({"0.2.2": seed, "0.3": out / "v0.3"}, logits)
    return made


def dtrain_logits(family: str, checkpoint: Path, run_dir: Path, writer: str) -> torch.Tensor:
    """dtrain's logits of IDS after starting a run of the family's tiny model from `checkpoint`."""
    args = MODELS[family][1]
    cfg = make_cfg(run_dir, family=family, initial_load_path=str(checkpoint), initial_load_writer=writer)
    model = get_family(family).model.model_cls(args)
    state = tiny_state(cfg, model=model)
    startup = CheckpointManager(
        cfg.checkpoint, run_dir, 0, 1, state, training=cfg.training, parallelism=cfg.parallelism, model=cfg.model,
        optimizer=cfg.optimizer, model_args=args,
    ).restore_at_startup()
    assert (startup.rule, startup.model_only) == ("initial_load", True)
    with torch.no_grad():
        return model.eval()(IDS)


@pytest.mark.parametrize(
    "family, version, writer",
    [("llama3", "0.2.2", "auto"), ("llama3", "0.3", "auto"),
     ("qwen3", "0.2.2", "torchtitan"), ("qwen3", "0.3", "auto")],
)
def test_a_torchtitan_checkpoint_gives_torchtitans_logits(torchtitan_checkpoints, tmp_path, family, version, writer):
    paths, expected = torchtitan_checkpoints[family]
    logits = dtrain_logits(family, paths[version], tmp_path, writer)
    assert (logits - expected).abs().max().item() <= TOLERANCE


def test_torchtitan_0_2_2_qwen3_is_refused_until_its_writer_is_named(torchtitan_checkpoints, tmp_path):
    paths, expected = torchtitan_checkpoints["qwen3"]
    with pytest.raises(DtrainError, match=r"set checkpoint\.initial_load_writer to dtrain or torchtitan"):
        dtrain_logits("qwen3", paths["0.2.2"], tmp_path / "auto", "auto")
    # What the refusal prevents: read as dtrain's layout, the same checkpoint gives other logits.
    logits = dtrain_logits("qwen3", paths["0.2.2"], tmp_path / "dtrain", "dtrain")
    assert (logits - expected).abs().max().item() > 100 * TOLERANCE
