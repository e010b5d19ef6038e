"""The model families the config offers: `model.name`'s choices and default, and the pipeline split `--help` shows.

Written here as data rather than read from the family registry (dtrain.parallelize.families), so that loading and
checking a config imports no model and no torch.distributed. tests/config/test_model_families.py holds them to the
registry and to the default family's DecoderLayout: a new family adds its name here too.
"""

from __future__ import annotations

MODEL_FAMILIES = ("llama3", "qwen3", "deepseek_v3")
DEFAULT_MODEL_FAMILY = "llama3"
# A two-stage split of the default family's two-block model: its layout's embedding and block 0, then block 1,
# final norm and head.
SPLIT_EXAMPLE_STAGES = (("tok_embeddings", "layers.0"), ("layers.1", "norm", "output"))
