"""`build_source`: the document source that `training.dataset` names.

A module of its own so that sources.py, the interface hf_source.py imports, does not import it back (no import
cycle); hf_source.py loads only when asked for (it needs `datasets`).
"""

from __future__ import annotations

from dtrain.config.schema import Training
from dtrain.data.sources import BuiltinSource, DocumentSource, FilesSource, SyntheticSource
from dtrain.data.tokenizer import Tokenizer
from dtrain.errors import DataError
from dtrain.step.rng import derive_seed

# torchtitan's names of the local C4 copy's parts (see hf_source.C4_KINDS; kept here so no import of datasets).
C4_NAMES = ("c4", "c4_test", "c4_validation")


def build_source(training: Training, tokenizer: Tokenizer, *, seed: int, split: str = "train") -> DocumentSource:
    """The document source that `training.dataset` names; `seed` (debug.seed) drives the synthetic one.

    `split="validation"` asks for held-out data: the built-in corpus's held-out part, synthetic documents from
    another seed; other kinds are read as `training.dataset_path` names them.
    """
    kind = training.dataset
    if kind == "builtin":
        return BuiltinSource(split=split)
    if kind == "synthetic":
        stream_seed = seed if split == "train" else derive_seed(seed, split)
        return SyntheticSource(stream_seed, tokenizer.vocab_size, training.seq_len)
    if kind == "files":
        return FilesSource(training.dataset_path, training.dataset_text_field)
    if kind in ("hf", *C4_NAMES):
        from dtrain.data.hf_source import C4_DEFAULT_PATH, HFSource

        # c4_validation is C4's held-out split by its name, whatever `split` asks.
        path = training.dataset_path or (C4_DEFAULT_PATH if kind != "hf" else "")
        return HFSource(path, training.dataset_text_field, kind)
    raise DataError(
        f"training.dataset = {kind!r} is not one of builtin, synthetic, files, hf, {', '.join(C4_NAMES)}"
    )
