"""Session-wide test settings: one shared inductor cache, quiet torchao, and the CUDA marker's skip."""

import os
import tempfile

import pytest

# Every cold compile costs 5–30 s on a small CPU; sharing one cache across the session (and its subprocesses,
# which inherit the environment) pays that once per graph.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dtrain_inductor_cache"))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
