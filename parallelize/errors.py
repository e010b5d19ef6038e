"""The one error type of dtrain.parallelize.

parallelize must not import the trainer, so it cannot raise the trainer's ConfigError; the trainer catches
ParallelismError and re-raises it as ConfigError. Being a ValueError, it also reads naturally to other callers.
"""


class ParallelismError(ValueError):
    """An impossible parallelism layout; the message is one line naming the config keys and the valid values."""
