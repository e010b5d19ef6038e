"""Low precision as model and optimizer transforms: float8 and MX training (torchao), low-bit optimizers."""
