"""The label the loss skips: a prompt's tokens, padding, a document's first token after another's (PyTorch's
cross_entropy default, as torchtitan and transformers use it). Data writes it, the step and validation skip it."""

IGNORE_INDEX = -100
