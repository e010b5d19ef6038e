"""Data: tokenizers, document sources, packing into fixed-length sequences, and the data-parallel data loader.

    tokenizer = build_tokenizer(cfg.model)
    loader = build_dataloader(cfg.training, tokenizer, dp_rank, dp_size, seed=cfg.debug.seed)
    batch = next(loader)  # {"input_ids": LongTensor[lbs, seq_len], "labels": LongTensor[lbs, seq_len]}

See docs/data.md for the sources, the packing and sharding rule, and resume semantics.
"""

from dtrain.data.dataloader import DataLoader, build_dataloader
from dtrain.data.source_factory import build_source
from dtrain.data.sources import DocumentSource
from dtrain.data.tokenizer import ByteTokenizer, Tokenizer
from dtrain.data.tokenizer_factory import build_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataLoader",
    "DocumentSource",
    "Tokenizer",
    "build_dataloader",
    "build_source",
    "build_tokenizer",
]
