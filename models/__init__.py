"""Single-device model families in plain PyTorch, installed as dtrain.models; nothing here imports the distributed package.

Each family lives in its own folder and exports one ``ModelFamily`` value (``models/family.py``); its models keep
the decoder protocol (``models/decoder.py``: ``DecoderLayout`` for module names, ``DecoderArgs`` for the args
shared code reads), build on the shared layers (``models/layers.py``) and call an inner attention module
(``models/attention.py``). The trainer finds a family by name through ``dtrain.parallelize.families``, which
pairs it with its parallelize plan::

    family = get_family("llama3").model
    args = replace(family.flavors["8B"], vocab_size=..., max_seq_len=..., tie_word_embeddings=...)
    with torch.device("meta"):
        model = family.model_cls(args)
"""

from .decoder import DecoderArgs, DecoderLayout, decoder_layout
from .family import ModelFamily
from .param_count import count_params

__all__ = ["DecoderArgs", "DecoderLayout", "ModelFamily", "count_params", "decoder_layout"]
